"""A serving layout is a Plan first: infer estimate's and infer serve's degrees, a decode experiment file and a
published serving run all become the inference estimator's config through lab.predict.inference.from_plan."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lab.cli.main import main
from lab.core.errors import UserError
from lab.core.hardware import get_chip
from lab.core.models import get_model
from lab.predict.inference.estimate import InferConfig, estimate_inference
from lab.predict.inference.from_plan import fill_degrees, infer_config, serving_degrees, serving_plan

H100 = get_chip("h100")


@pytest.mark.parametrize(
    ("given", "filled"),
    [
        ((8, None, None, None), (8, 1, 1)),  # neither: the model is sharded, not the batch
        ((8, None, None, 2), (4, 1, 2)),  # the experts take theirs first
        ((8, 2, None, None), (2, 4, 1)),
        ((8, None, 2, None), (4, 2, 1)),
        ((16, 2, 2, 4), (2, 2, 4)),
    ],
)
def test_the_degree_left_out_is_filled_from_the_chips(given, filled):
    assert fill_degrees(*given) == filled


@pytest.mark.parametrize(
    ("given", "ep_flag", "said"),
    [
        ((8, 3, None, None), True, "--tp x --dp x --ep must equal --chips 8; got tp=3"),
        ((3, 2, None, None), False, "--tp x --dp must equal --chips 3; got tp=2"),
        ((8, 2, 2, None), False, "got tp=2, dp=2"),
        ((8, None, None, 3), True, "got ep=3"),
    ],
)
def test_degrees_that_do_not_multiply_to_the_chips_are_refused_naming_them(given, ep_flag, said):
    with pytest.raises(UserError, match="must equal --chips") as err:
        fill_degrees(*given, ep_flag=ep_flag)
    assert said in str(err.value)


@pytest.mark.parametrize(("tp", "dp", "ep"), [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 8), (4, 3, 2)])
def test_a_serving_plan_gives_back_its_degrees_and_its_chips(tp, dp, ep):
    model = get_model("mixtral-8x7b")
    plan = serving_plan(model, batch=48, tp=tp, dp=dp, ep=ep, prefill_len=128, generate=16)
    assert plan.program == "decode"
    assert serving_degrees(plan) == (tp, dp, ep)
    assert plan.devices == tp * dp * ep
    cfg = infer_config(plan, H100)
    assert (cfg.tp, cfg.dp, cfg.ep, cfg.chips) == (tp, dp, ep, tp * dp * ep)
    assert (cfg.batch, cfg.prefill_len, cfg.generate) == (48, 128, 16)


def test_the_serving_plan_is_the_books_form_not_the_labs_program():
    """Embedding and logits replicated (no vocab-parallel all-reduce), attention fused: what InferConfig's defaults
    price, so a layout priced through its Plan costs what the same fields priced directly cost."""
    model = get_model("llama3-8b")
    plan = serving_plan(model, batch=16, tp=4, dp=2, prefill_len=512)
    cfg = infer_config(plan, H100, context=4096, achievable=True)
    direct = InferConfig(model=model, chip=H100, batch=16, context=4096, tp=4, dp=2, prefill_len=512, achievable=True)
    assert cfg == direct
    assert estimate_inference(cfg).decode_step_s == estimate_inference(direct).decode_step_s


def test_a_decode_plan_with_experts_counts_replicas_over_the_expert_ranks():
    """The batch's axes include the experts'; the replicas are what is left (before: every expert rank a replica)."""
    plan = serving_plan(get_model("mixtral-8x7b"), batch=32, tp=2, dp=1, ep=4)
    deg = plan.degrees()
    assert deg["dp"] * deg["fsdp"] == 4 and deg["ep"] == 4
    assert serving_degrees(plan) == (2, 1, 4)


def test_the_stack_fields_override_the_plans_and_a_plan_keeps_its_own(tmp_path):
    plan = serving_plan(get_model("llama3-8b"), batch=4, tp=2)
    cfg = infer_config(plan, H100, weights="int4", kv="fp8", step_overhead_s=0.002, tp_allreduce="custom")
    assert (cfg.weights, cfg.kv, cfg.compute) == ("int4", "fp8", "bf16")
    assert (cfg.step_overhead_s, cfg.tp_allreduce) == (0.002, "custom")
    lab_program = dataclasses.replace(plan, rules=dataclasses.replace(plan.rules, vocab="model"))
    assert infer_config(lab_program, H100).vocab_parallel and not cfg.vocab_parallel


def test_infer_estimate_prices_its_flags_through_the_plan(capsys):
    """The command's numbers are the Plan's config's, degrees filled by the one rule (ep given, tp filled)."""
    main(
        [
            "infer", "estimate", "--model", "mixtral-8x7b", "--hardware", "h100", "--chips", "8", "--ep", "2",
            "--batch", "64", "--context", "2048", "--achievable", "--json",
        ]
    )  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    plan = serving_plan(get_model("mixtral-8x7b"), batch=64, tp=4, dp=1, ep=2)
    want = estimate_inference(infer_config(plan, H100, context=2048))
    assert got["decode_step_s"] == want.decode_step_s
    assert (
        got["decode_step_s"]
        == estimate_inference(
            InferConfig(model=get_model("mixtral-8x7b"), chip=H100, batch=64, context=2048, tp=4, ep=2, achievable=True)
        ).decode_step_s
    )
