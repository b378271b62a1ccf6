"""The test split's data files: one TOML file a source, read by one typed loader that refuses a bad file by name.

These tests write their own files; they never price a run (the test split's runs enter before the estimators see
them, so nothing here reads the shipped ones' predictions).
"""

import pytest

from lab.core.errors import UserError
from lab.studies import run_files

SOURCE = """
[source]
key = "example-2024"
cite = "A. Author, 'A post', A blog (Jan 2024), Table 2"
url = "https://example.org/post"
grade = "B"
stack = "an engine, CUDA graphs"
assumed = "fp16 taken as bf16"
rule = "every row of Table 2"
"""

SERVING = """
[[run]]
case_id = "X001"
kind = "serving"
chip = "a100-80gb"
chips = 2
model = "llama2-7b"
layout = { tp = 2, batch = 4, prompt = 512, generated = 128 }
dtype = "bf16"
measured = 0.0123
unit = "s/token"
quote = "Table 2: 12.3 ms"
"""

TRAINING = """
[[run]]
case_id = "X002"
kind = "training"
chip = "h100"
chips = 16
model = "llama3-8b"
overrides = { name = "my-8b", vocab = 32000 }
layout = { fsdp = 16 }
seq_len = 4096
global_batch = 64
microbatch = 4
dtype = "bf16"
remat = "none"
measured = 9000.0
unit = "tokens/s/chip"
node_network_gbps = 3200.0
"""


def test_a_source_file_becomes_runs_with_the_sources_citation_and_the_split():
    runs = run_files.parse(SOURCE + SERVING + TRAINING, "x.toml")
    serve, train = runs
    assert serve.split == train.split == "test" and serve.source_name == "example-2024"
    assert serve.source == "A. Author, 'A post', A blog (Jan 2024), Table 2 (https://example.org/post)"
    assert serve.grade == "B" and serve.stack == "an engine, CUDA graphs" and serve.assumed == "fp16 taken as bf16"
    # a serving run's training fields say one step of its batch
    assert (serve.seq_len, serve.global_batch, serve.microbatch, serve.remat) == (640, 4, 4, "none")
    assert train.layout == {"fsdp": 16} and train.overrides == {"name": "my-8b", "vocab": 32000}
    assert train.node_network_gbps == 3200.0 and train.quote == ""


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('chip = "a100-80gb"', 'chip = "a10z"'), r"run X001: chip 'a10z' is not in the catalog; give expressible"),
        (("measured = 0.0123", "measured = -1.0"), r"run X001: measured must be a positive number, got -1.0"),
        (('unit = "s/token"', 'unit = "s/step"'), r"run X001: unit 's/step' is not one of s/token, s/prefill"),
        (('kind = "serving"', 'kind = "serve"'), r"run X001: kind 'serve' is not one of training, serving"),
        (("tp = 2, batch", "tp = 2, btach"), r"run X001: layout.btach is not a serving layout field; valid: tp"),
        (("tp = 2,", "tp = 0,"), r"run X001: layout.tp must be positive, got 0"),
        (("chips = 2", 'chips = "2"'), r"run X001: chips must be int, got '2'"),
        (("quote =", "qoute ="), r"run X001: qoute is not a run field; valid: case_id"),
        (('grade = "B"', 'grade = "D"'), r"\[source\] grade 'D' is not one of A, B, C"),
        (('rule = "every row of Table 2"', ""), r"\[source\] needs rule"),
        (("[[run]]", "[[runs]]"), r"unknown top-level key 'runs'"),
        (('dtype = "bf16"', "dtype = bf16"), r"x.toml: not TOML"),
        (('dtype = "bf16"', 'dtype = "bf16"\ntp_allreduce = "gloo"'), r"run X001: tp_allreduce 'gloo' is not one of"),
        (('dtype = "bf16"', 'dtype = "bf16"\nmoe_weights = "some"'), r"run X001: moe_weights 'some' is not one of"),
    ],
)
def test_a_bad_file_is_refused_with_one_line_naming_the_value(edit, message):
    text = (SOURCE + SERVING).replace(*edit)
    with pytest.raises(UserError, match=message):
        run_files.parse(text, "x.toml")


def test_a_run_the_catalog_cannot_price_enters_with_its_reason():
    reason = 'chip = "mi300x"\nexpressible = "chip mi300x is not in the catalog"'
    text = (SOURCE + SERVING).replace('chip = "a100-80gb"', reason)
    (run,) = run_files.parse(text, "x.toml")
    assert run.expressible == "chip mi300x is not in the catalog"


def test_a_folder_of_sources_refuses_a_case_id_twice(tmp_path):
    (tmp_path / "a.toml").write_text(SOURCE + SERVING)
    (tmp_path / "b.toml").write_text(SOURCE + SERVING)
    with pytest.raises(UserError, match=r"case X001 appears twice"):
        run_files.load_folder(tmp_path)
    (tmp_path / "b.toml").write_text(SOURCE + TRAINING)
    assert [r.case_id for r in run_files.load_folder(tmp_path)] == ["X001", "X002"]


def test_the_checker_reads_files_and_prices_nothing(tmp_path, capsys):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(SOURCE + SERVING + TRAINING)
    bad.write_text(SOURCE)
    assert run_files.main([str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: 2 runs (1 training, 1 serving), 0 marked not expressible"
    assert run_files.main([str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}: no [[run]] tables"]
