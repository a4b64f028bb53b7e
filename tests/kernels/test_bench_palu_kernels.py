import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from hf_accel.kernels import benchmark
from hf_accel.kernels.reference import dequantize_attend, rope_key_scores


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_palu_kernels.py"


def test_script_without_gpu_says_so_and_exits_zero(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--json", "--seq-lens", "4096"])
    module = runpy.run_path(str(SCRIPT))
    assert module["main"](["--json", "--seq-lens", "4096"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["gpu"] is None and report["results"] == [] and "no CUDA GPU" in report["error"]
    assert module["main"]([]) == 0
    assert "No GPU" in capsys.readouterr().out


def test_script_refuses_a_bad_layout_in_one_line(capsys):
    module = runpy.run_path(str(SCRIPT))
    with pytest.raises(SystemExit) as exit_info:
        module["main"](["--group-size", "3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "error: group_size=3 must be positive and divide num_key_value_heads=8" in err


def test_benchmarked_palu_path_equals_sdpa_on_reconstructed_states(monkeypatch):
    # the timed palu path (scores kernel → softmax → p·H^v, B^v folded later) must compute the same attention
    config = benchmark.PaluAttentionBenchConfig(
        num_heads=8, num_key_value_heads=4, head_dim=16, group_size=2, warmup=0, iters=1
    )
    monkeypatch.setattr(benchmark, "_time_ms", lambda fn, warmup, iters: fn() is not None and 1.0)
    row = benchmark._measure_length(config, 40, rope_key_scores, "cpu", dequantize_attend)
    assert row["seq_len"] == 40 and row["speedup_vs_full"] == 1.0 and "palu_fused_v4_ms" in row
    report = {"gpu": "test", "ranks": {}, "max_rel_error": 0.0, "results": [row]}
    assert "palu_v4" in benchmark.format_report(report)
    x = {k: v.float() if v.is_floating_point() else v for k, v in benchmark._make_inputs(config, 40, "cpu").items()}
    latent_out = benchmark._palu_fused(x, config, rope_key_scores)  # [B, G, s·n_rep, r_v]
    num_rep = config.num_heads // config.num_key_value_heads
    up_v = x["up_v"].view(config.groups, -1, config.group_size, config.head_dim)  # [G, r_v, s, d]
    head_kv = torch.arange(config.group_size * num_rep) // num_rep  # kv head (within the group) of each query head
    out = torch.einsum("bgmr,gmrd->bgmd", latent_out, up_v[:, :, head_kv].permute(0, 2, 1, 3))
    keys = benchmark._rope(benchmark._reconstruct(x["latent_keys"], x["up_k"], 16), x["positions"], x["inv_freq"])
    values = benchmark._reconstruct(x["latent_values"], x["up_v"], 16)
    expected = torch.nn.functional.scaled_dot_product_attention(x["query"], keys, values, enable_gqa=True)
    torch.testing.assert_close(out.reshape(expected.shape), expected, atol=1e-4, rtol=1e-4)


def test_timed_runs_start_from_a_flushed_l2_cache(monkeypatch):
    # every timed run reads its inputs from memory, not from an L2 cache left warm by the previous run; the flush
    # itself is queued before the start event, so it is not timed
    calls = []

    class FakeEvent:  # created in pairs: start, end
        created = 0

        def __init__(self, enable_timing):
            self.label = ("start", "end")[FakeEvent.created % 2]
            FakeEvent.created += 1

        def record(self):
            calls.append(self.label)

        def elapsed_time(self, other):
            return 1.0

    class FakeBuffer:
        def zero_(self):
            calls.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(benchmark, "_l2_flush_buffer", lambda: FakeBuffer())
    assert benchmark._time_ms(lambda: calls.append("fn"), warmup=2, iters=3) == 1.0
    assert calls == ["fn"] * 2 + ["flush", "start", "fn", "end"] * 3


@pytest.mark.parametrize(
    "shape",
    [{"group_size": 3}, {"num_heads": 12}, {"group_size": 0}, {"num_key_value_heads": 0}, {"num_heads": 0}],
    ids=["group-not-dividing", "heads-not-dividing", "zero-group", "zero-kv-heads", "zero-heads"],
)
def test_a_layout_whose_groups_do_not_tile_the_heads_is_refused_in_one_line(shape):
    # a zero group size or KV-head count raised ZeroDivisionError ("integer modulo by zero") from the check itself
    with pytest.raises(ValueError) as error:
        benchmark.PaluAttentionBenchConfig(**shape)
    message = str(error.value)
    assert "must be positive and divide" in message and "\n" not in message
    assert f"{next(iter(shape))}={next(iter(shape.values()))}" in message
