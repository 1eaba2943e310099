"""pretrain.profiling: what a torch.profiler Chrome trace says about device busy time and host waits.

The trainer's use of it (--profile-steps on a real run) is tested in test_trainer.py (the stop3 launch)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.profiling import describe, kernel_family, summarize_trace, union_seconds


def kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"device": 0, "stream": stream}}


def host(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_union_of_intervals():
    assert union_seconds([]) == 0
    assert union_seconds([(0, 10), (5, 20), (30, 40)]) == pytest.approx(30e-6)
    assert union_seconds([(30, 40), (0, 100)]) == pytest.approx(100e-6)


def test_kernel_families():
    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_family("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert kernel_family("fmha_cutlassB_bf16_aligned_64x64_k64_sm80") == "attention_bwd"
    assert kernel_family("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention_fwd"
    assert kernel_family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention_bwd"
    assert kernel_family("triton_red_fused__to_copy_exp_logsumexp_neg_scatter_add_sub_unsqueeze_0") == "loss"
    assert kernel_family("triton_red_fused_embedding_dense_backward_sum_3") == "embedding_bwd"
    assert kernel_family("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "nccl"
    assert kernel_family("triton_per_fused_add_mul_rsqrt_0") == "norm"
    assert kernel_family("triton_poi_fused__unsafe_view_cat_gelu_gelu_backward_mul_split_view_0") == "triton"
    assert kernel_family("multi_tensor_apply_kernel<AdamFunctor>") == "optimizer"
    # ours: pretrain/model/relative_attention.py's kernels and pretrain/one_pass_adamw.py's
    from pretrain.model import relative_attention
    from pretrain.one_pass_adamw import _adamw_kernel
    assert kernel_family(relative_attention._attn_fwd_kernel.fn.__name__) == "attention_fwd"
    for kernel in (relative_attention._attn_bwd_kv_kernel, relative_attention._attn_bwd_q_kernel,
                   relative_attention._attn_bwd_delta_kernel):
        assert kernel_family(kernel.fn.__name__) == "attention_bwd"
    assert kernel_family(_adamw_kernel.fn.__name__) == "optimizer"
    from pretrain.model import fp8, gated_gelu        # the gate's and FP8's casts: other fused kernels (family_rules 2)
    for kernel in (gated_gelu._gated_gelu_fwd_kernel, gated_gelu._gated_gelu_bwd_kernel, fp8._cast_kernel):
        assert kernel_family(kernel.fn.__name__) == "triton"
    assert kernel_family("void at::native::vectorized_elementwise_kernel") == "other"


def test_summary_of_a_synthetic_two_stream_trace(tmp_path):
    # a 1000 us window: compute stream busy 0-300 and 500-700, NCCL on another stream 250-450 (overlapping 50 us);
    # the host waits 200 us in a stream sync and 100 us in an event sync; trainer phases as record_function ranges
    events = [host("user_annotation", "pretrain.forward", 0, 400), host("user_annotation", "pretrain.backward", 400, 500),
              host("user_annotation", "pretrain.step", 900, 100), host("user_annotation", "other.range", 0, 5),
              kernel("nvjet_gemm", 0, 300), kernel("fmha_cutlassB", 500, 200),
              kernel("ncclDevKernel_AllGather", 250, 200, stream=20),
              host("cuda_runtime", "cudaStreamSynchronize", 600, 200), host("cuda_runtime", "cudaEventSynchronize", 850, 100),
              host("cuda_runtime", "cudaStreamWaitEvent", 10, 1), host("cuda_runtime", "cudaLaunchKernel", 0, 5),
              {"ph": "M", "name": "process_name"}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    summary = summarize_trace(path, window_s=1000e-6)
    assert summary["device_events"] == 3
    assert summary["device_busy_s"] == pytest.approx(650e-6)          # 0-450 and 500-700
    assert summary["device_busy_share"] == pytest.approx(0.65)
    assert summary["streams"]["device 0 stream 7"]["busy_s"] == pytest.approx(500e-6)
    assert summary["streams"]["device 0 stream 20"]["kernels"] == 1
    assert summary["families"]["gemm"]["seconds"] == pytest.approx(300e-6)
    assert summary["families"]["nccl"]["share_of_kernel_time"] == pytest.approx(200 / 700, abs=1e-4)
    assert summary["host_sync_s"] == pytest.approx(300e-6)            # cudaStreamWaitEvent does not block
    assert summary["sync_calls"]["cudaStreamWaitEvent"]["calls"] == 1
    assert summary["host_phases"]["backward"] == {"calls": 1, "seconds": pytest.approx(500e-6), "share": 0.5}
    assert set(summary["host_phases"]) == {"forward", "backward", "step"}
    assert summary["top_kernels"][0]["name"] == "nvjet_gemm"
    assert summary["idle_gaps"] == [{"between": "ncclDevKernel_AllGather -> fmha_cutlassB", "gaps": 1,
                                     "seconds": pytest.approx(50e-6)}]       # 450-500: the NCCL kernel ended last
    line = describe(summary, steps=1)
    assert "device busy 65.0%" in line and "backward 50%" in line and "syncs 30.0%" in line


def test_memsets_and_copies_are_named_by_the_host_op_that_made_them(tmp_path):
    """By "External id" where the device event has one; else by its runtime call's "correlation" and the innermost op
    around that call on the same thread (not an op of another thread that spans it too); else "?"."""
    def op(name, ts, dur, external, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid,
                "args": {"External id": external}}

    def device(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": 0, "stream": 7, **args}}

    events = [op("aten::zero_", 0, 10, 1), op("aten::copy_", 20, 10, 2),
              op("aten::linear", 40, 30, 3), op("aten::zeros", 50, 10, 4), op("other::thread", 0, 100, 9, tid=2),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemsetAsync", "ts": 55, "dur": 1, "tid": 1,
               "args": {"correlation": 77}},
              device("gpu_memset", "Memset (Device)", 100, 4, **{"External id": 1}),
              device("gpu_memset", "Memset (Device)", 110, 4, **{"External id": 1}),
              device("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 120, 6, **{"External id": 2}),
              device("gpu_memset", "Memset (Device)", 130, 2, correlation=77),
              device("gpu_memset", "Memset (Device)", 140, 1),
              kernel("nvjet_gemm", 150, 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert summarize_trace(path)["memsets_and_copies"] == [
        {"what": "Memset (Device) <- aten::zero_", "calls": 2, "seconds": pytest.approx(8e-6)},
        {"what": "Memcpy DtoD (Device -> Device) <- aten::copy_", "calls": 1, "seconds": pytest.approx(6e-6)},
        {"what": "Memset (Device) <- aten::zeros", "calls": 1, "seconds": pytest.approx(2e-6)},
        {"what": "Memset (Device) <- ?", "calls": 1, "seconds": pytest.approx(1e-6)}]


def test_a_real_cpu_trace(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("pretrain.forward"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    summary = summarize_trace(path)
    assert summary["device_events"] == 0 and summary["window_s"] > 0
    assert summary["host_phases"]["forward"]["calls"] == 1
    assert "no device kernels" in describe(summary, steps=1)


def test_profile_table_of_a_study(tmp_path):
    # scripts/profile_table.py over a study's runs/: the synthetic trace above as two points' profiles, 2 steps each;
    # one point also has its untraced steps' median (pretrain's summary.json) and another persistence threshold;
    # one kernel under the name our Triton attention's backward had before its `_attn_` name ("other" then)
    events = [kernel("nvjet_gemm", 0, 300), kernel("fmha_cutlassB", 500, 200),
              kernel("ncclDevKernel_AllGather", 250, 200, stream=20), kernel("_backward_kv_kernel", 800, 100)]
    for name, threshold, untraced_s in (("mt5-xl-z3-a", None, None), ("mt5-xl-z3-b", 10 ** 12, 0.001)):
        run = tmp_path / "study" / "runs" / name
        (run / "profile").mkdir(parents=True)
        with gzip.open(run / "profile" / "trace-rank0.json.gz", "wt") as handle:
            json.dump({"traceEvents": events}, handle)
        summary = {"steps": 2, **summarize_trace(run / "profile" / "trace-rank0.json.gz", window_s=1000e-6)}
        assert summary.pop("family_rules") == 2
        if untraced_s:      # one summary as written before family_rules 2: its row is marked
            summary["family_rules"] = 2
        (run / "profile" / "summary.json").write_text(json.dumps(summary))
        (run / "config.json").write_text(json.dumps({       # the shape pretrain writes: TrainConfig under "train"
            "train": {"model": "mt5-xl", "zero": 3, "offload": "none", "micro_batch": 16, "global_batch": 32,
                      "stage3_param_persistence_threshold": threshold, "out": str(run)},
            "model": {"d_model": 2048}, "world_size": 1, "grad_accum": 2, "global_batch": 32}))
        if untraced_s:
            (run / "summary.json").write_text(json.dumps({"median": {"step_time_s": untraced_s}}))
    script = Path(__file__).resolve().parents[2] / "scripts" / "profile_table.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "study"), "--out", str(tmp_path / "t.md")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line for line in (tmp_path / "t.md").read_text().splitlines() if line.startswith("| mt5-xl")]
    traced, untraced = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    # no untraced median: the traced window per step (1000 us over 2 steps), its shares of that
    assert traced[:3] == ["mt5-xl ZeRO 3, micro 16 x 2, stage3_param_persistence_threshold=None *",
                          "0.5 (traced)", "0.5"]
    assert "*: a summary from before family_rules 2" in (tmp_path / "t.md").read_text()
    # (the renamed kernel counted as attention backward, not as other)
    assert traced[3] == "30.0%" and traced[5] == "30.0%" and traced[11] == "20.0%" and traced[13] == "0.0%"
    assert traced[-1] == "25.0%"
    # the untraced 1 ms step: the same kernel time per step (150 us of GEMM) over it, the rest idle
    assert untraced[:3] == ["mt5-xl ZeRO 3, micro 16 x 2, stage3_param_persistence_threshold=1000000000000",
                            "1.0", "0.5"]
    assert untraced[3] == "15.0%" and untraced[5] == "15.0%" and untraced[-1] == "62.5%"
    empty = subprocess.run([sys.executable, str(script), str(tmp_path / "study" / "runs" / "nothing-here")],
                           capture_output=True, text=True)
    assert empty.returncode == 2 and "no such directory" in empty.stderr and "Traceback" not in empty.stderr
