"""Every efficiency constant carries a grade (A measured on the family, B carried over or derived, C assumed), a source
and, where it is not A, a stated alternative that a swap puts in place and takes back."""

import json
import numbers

import pytest

from lab.cli.main import main
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict import constants as K
from lab.predict import efficiency as eff
from lab.predict.inference.estimate import InferConfig, estimate_inference
from lab.predict.training import estimate as training


def _tables(module):
    """Every module-level number or table of numbers, as (attr, key) pairs (key None for a scalar)."""
    out = []
    for attr, value in vars(module).items():
        if attr in K.NOT_CONSTANTS or not attr.lstrip("_").replace("_", "").isupper() or isinstance(value, bool):
            continue
        if isinstance(value, numbers.Real):
            out.append((attr, None))
        elif isinstance(value, dict) and value and all(isinstance(v, numbers.Real) for v in value.values()):
            out.extend((attr, k) for k in value)
        elif isinstance(value, tuple) and value and all(isinstance(p, tuple) for p in value):
            out.append((attr, None))  # a curve (NIC_CURVE)
    return out


def test_every_number_of_the_efficiency_model_is_graded():
    registered = {(c.module, c.attr, c.key) for c in K.CONSTANTS}
    found = _tables(eff)
    assert len(found) > 50 and ("GEMM_CEILING", ("h100", "bf16")) in found and ("NIC_CURVE", None) in found
    missing = [(a, k) for a, k in found if (eff.__name__, a, k) not in registered]
    assert not missing, f"give these a grade in lab/predict/constants.py: {missing}"
    for attr in ("NORM_BYTES", "ROPE_BYTES", "SWIGLU_BYTES"):  # the eager stack's counts in the training step
        assert (training.__name__, attr, "eager") in registered


def test_each_constant_has_a_grade_a_source_and_a_real_alternative():
    assert len({c.name for c in K.CONSTANTS}) == len(K.CONSTANTS)
    for c in K.CONSTANTS:
        assert c.grade in K.GRADES and c.source and c.why, c.name
        assert c.alternative != c.value, c.name
        assert c.chips, c.name


def test_a_swap_prices_with_the_alternative_and_takes_it_back():
    v4 = get_chip("tpu-v4")
    cfg = InferConfig(get_model("llama2-7b"), v4, batch=1, context=1024, tp=4, achievable=True)
    before = estimate_inference(cfg).decode_step_s
    c = K.get("decode.weights.tpu")
    assert c.grade == "B" and c.value == 0.87
    with K.swapped("decode.weights.tpu"):
        assert eff.decode_weight_fraction(v4) == 0.68
        during = estimate_inference(cfg).decode_step_s
    assert during > before and estimate_inference(cfg).decode_step_s == before
    assert eff.decode_weight_fraction(v4) == 0.87
    with K.swapped("ici.fraction.other", values={"ici.fraction.other": 0.5}):
        assert eff.collective_fraction(v4, "all-gather", 4, "node") == 0.5
        assert eff.collective_fraction(get_chip("tpu-v5e"), "all-gather", 4, "node") == 0.95  # v5e's is measured
    assert eff.collective_fraction(v4, "all-gather", 4, "node") == 0.95


def test_an_unknown_constant_is_refused_by_name():
    from lab.core.errors import UserError

    with pytest.raises(UserError, match=r"unknown constant 'gemm.h999'; valid: gemm.a100.bf16"):
        K.get("gemm.h999")


def test_uncertain_constants_of_a_chip_are_the_ones_touching_its_family_or_kind():
    h100 = {c.name for c in K.uncertain("h100", "gpu")}
    assert {"attention.h100.fa3", "nic.fraction", "tile.gpu"} <= h100
    assert not {"attention.h200.fa3", "decode.weights.tpu", "gemm.a100.int8"} & h100
    assert all(c.grade != "A" for c in K.uncertain())


def test_the_sensitivity_table_names_what_moves_a_class(capsys):
    assert main(["validate", "--group", "development", "--sensitivity", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"development", "sensitivity"}
    sens = {c["name"]: c for c in data["sensitivity"]["constants"]}
    assert set(sens) == {c.name for c in K.uncertain()}
    base = data["sensitivity"]["baseline"]["development"]
    # the TPU decode rows stream weights at G16's Hopper figure: its alternative moves TPU serving, and nothing else
    tpu = sens["decode.weights.tpu"]["mean_abs_error"]["development"]
    assert tpu["TPU serving"] != base["TPU serving"] and tpu["GPU training"] == base["GPU training"]
    assert main(["validate", "--group", "calibration", "--sensitivity"]) == 2
    assert "--sensitivity prices the development set and the test split" in capsys.readouterr().err


@pytest.mark.parametrize("chip", ["h100", "a100-80gb", "tpu-v5e", "tpu-v4"])
def test_a_constant_said_to_enter_one_estimator_leaves_the_other_alone(chip):
    """The intervals swap only the constants an estimate can lean on (Constant.prices): a decode step's figures never
    move a training step, an attention kernel's or the overlap's never a decode step."""
    from lab.predict.training.config import Layout, TrainConfig
    from lab.predict.training.estimate import estimate

    c = get_chip(chip)
    m = get_model("llama3-8b")
    train = TrainConfig(m, c, Layout(fsdp=4, tp=2), seq_len=4096, global_batch=32)
    serve = InferConfig(m, c, batch=8, context=2048, tp=2, prefill_len=512, achievable=True, weights="int8")
    base_t, base_s = estimate(train).step_time_s, estimate_inference(serve)
    for k in K.uncertain():
        if k.prices == ("training", "serving"):
            continue
        with K.swapped(k.name):
            if "training" not in k.prices:
                assert estimate(train).step_time_s == base_t, k.name
            if "serving" not in k.prices:
                got = estimate_inference(serve)
                assert (got.decode_step_s, got.prefill_s) == (base_s.decode_step_s, base_s.prefill_s), k.name
