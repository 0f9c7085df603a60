"""analysis/profile: a profiler trace's device kernels summed by category, read through the compiled program."""
import gzip
import json

import pytest

from starscream_jax.analysis.profile import (CATEGORIES, breakdown_table, hlo_categories, host_events, idle_causes,
                                             time_breakdown)
from starscream_jax.errors import StarscreamError

HLO = """
ENTRY %main {
  %gemm_fusion_dot.1 = bf16[128,256]{1,0} fusion(bf16[128,64]{1,0} %p0, bf16[64,256]{1,0} %p1), kind=kCustom, calls=%c, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}, metadata={op_name="jit(step)/qkv/dot_general"}
  %custom-call.2 = (bf16[128,256]{1,0}, s8[0]{0}) custom-call(bf16[128,64]{1,0} %p0, bf16[64,256]{1,0} %p1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/down/dot_general"}
  %custom-call.3 = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/attention/dot_product_attention"}
  %all-reduce-start.4 = (f32[64]{0}, f32[64]{0}) all-reduce-start(f32[64]{0} %g), replica_groups={{0,1}}, to_apply=%add
  %loop_fusion.5 = f32[64]{0} fusion(f32[64]{0} %a), kind=kLoop, calls=%f, metadata={op_name="jit(step)/optimizer/mul"}
  ROOT %loop_fusion.6 = bf16[128,64]{1,0} fusion(bf16[128,64]{1,0} %x), kind=kLoop, calls=%r, metadata={op_name="jit(step)/rope/mul"}
}
"""


def trace_file(directory, kernels):
    """A perfetto trace as jax.profiler writes it: a host process, a device process with a stream thread and a
    summary thread (whose events repeat the kernels and must not be counted)."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
              {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5000.0, "name": "PjitFunction(step)"}]
    for name, hlo_op, microseconds in kernels:
        for tid in (7, 9):
            events.append({"ph": "X", "pid": 2, "tid": tid, "ts": 0, "dur": microseconds, "name": name,
                           "args": {"hlo_op": hlo_op}})
    path = directory / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)


def test_categories_come_from_the_compiled_program():
    categories = hlo_categories(HLO)
    assert categories["loop_fusion_5"] == "optimizer"  # the name its kernel runs under
    by_instruction = {name: category for name, category in categories.items() if "." in name}
    assert by_instruction == {"gemm_fusion_dot.1": "matmuls", "custom-call.2": "matmuls", "custom-call.3": "attention",
                          "all-reduce-start.4": "collectives", "loop_fusion.5": "optimizer",
                          "loop_fusion.6": "other"}


def test_breakdown_sums_stream_kernels_per_step(tmp_path):
    trace_file(tmp_path, [("triton_gemm_kernel", "gemm_fusion_dot.1", 400.0),
                          ("sm90_xmma_gemm_bf16", "custom-call.2", 200.0),
                          ("cudnn_generated_sdpa", "custom-call.3", 300.0),
                          ("ncclDevKernel_AllReduce_Sum_f32", "all-reduce-start.4", 100.0),
                          ("loop_fusion_5", "command_buffer_3", 60.0),  # inside a CUDA graph: named after its HLO
                          ("loop_fusion_6", "loop_fusion.6", 40.0),
                          ("nvjet_hsh_64x8_gemm", "", 10.0),  # no HLO op: named a GEMM, counted as one
                          ("nvjet_hsh_64x8_gemm", "", 10.0)])  # the same kernel again: one entry, two launches
    breakdown = time_breakdown(tmp_path, steps=2, hlo_text=HLO)
    seconds = breakdown["per_step_s"]
    assert list(seconds) == list(CATEGORIES)
    expected = {"matmuls": 620e-6, "attention": 300e-6, "collectives": 100e-6, "optimizer": 60e-6, "other": 40e-6}
    assert seconds == pytest.approx({name: value / 2 for name, value in expected.items()})
    assert breakdown["devices"] == 1 and breakdown["kernels"] == 8
    assert breakdown["top_kernels"][0]["name"] == "triton_gemm_kernel"
    gemm = next(kernel for kernel in breakdown["top_kernels"] if kernel["name"] == "nvjet_hsh_64x8_gemm")
    assert gemm["launches_per_step"] == 1.0 and gemm["per_step_s"] == pytest.approx(10e-6)
    table = breakdown_table({"starscream_tp": breakdown})
    assert "| starscream_tp | 0.3 ms (55%)" in table and "0.6 ms |" in table


def test_cudnn_attention_backward_helpers_count_as_attention(tmp_path):
    # kernels of cuDNN's attention backward pass that run inside a CUDA graph, where only their names tell
    trace_file(tmp_path, [("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "command_buffer_1", 50.0),
                          ("cudnn::fusion::compute_dot_do_o_specialized", "command_buffer_1", 30.0),
                          ("cudnn::fusion::convert_dq_to_16bits", "command_buffer_1", 20.0),
                          ("loop_fusion_6", "command_buffer_1", 10.0)])
    seconds = time_breakdown(tmp_path, steps=1, hlo_text=HLO)["per_step_s"]
    assert seconds["attention"] == pytest.approx(100e-6) and seconds["other"] == pytest.approx(10e-6)


def test_a_trace_without_device_kernels_is_a_clear_error(tmp_path):
    with pytest.raises(StarscreamError, match="no perfetto_trace"):
        time_breakdown(tmp_path, steps=1)
    trace_file(tmp_path, [])
    with pytest.raises(StarscreamError, match="no device kernels"):
        time_breakdown(tmp_path, steps=1)


def test_host_events_rank_names_by_their_own_time(tmp_path):
    # host thread 1: dispatch (10 ms) holding a launch (6 ms) holding a graph update (4.5 ms); a wait (3 ms);
    # thread 2: another launch (1 ms). Device events are not host events.
    trace_file(tmp_path, [("loop_fusion_6", "loop_fusion.6", 40.0)])
    path = next(tmp_path.glob("**/perfetto_trace.json.gz"))
    with gzip.open(path, "rt") as handle:
        trace = json.load(handle)
    trace["traceEvents"] = [event for event in trace["traceEvents"] if event["pid"] != 1 or event["ph"] == "M"] + [
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10000.0, "name": "engine.py:706 dispatch"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 1000, "dur": 6000.0, "name": "Execute"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 2000, "dur": 4500.0, "name": "GraphUpdate"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 10000, "dur": 3000.0, "name": "wait"},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 500, "dur": 1000.0, "name": "Execute"}]
    with gzip.open(path, "wt") as handle:
        json.dump(trace, handle)
    events = {event.name: event for event in host_events(tmp_path)}
    assert list(events) == ["GraphUpdate", "engine.py:706 dispatch", "wait", "Execute"]
    assert events["Execute"].count == 2 and events["Execute"].seconds == pytest.approx(7e-3)
    assert events["Execute"].self_seconds == pytest.approx(2.5e-3)  # 1.5 ms of its own on thread 1, 1 ms on 2
    assert events["engine.py:706 dispatch"].self_seconds == pytest.approx(4e-3)
    assert "loop_fusion_6" not in events
    assert host_events(tmp_path, top=1)[0].name == "GraphUpdate"


def test_idle_device_time_is_laid_at_the_innermost_host_event_open_then(tmp_path):
    # the device runs kernels at 0-100, 300-400 and 1000-1100 us (two streams, one kernel each time): idle 100-300
    # and 400-1000. The engine thread's step holds a launch (350-950) holding a graph update (500-600); another
    # thread waits 0-150.
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "engine"}},
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "waiter"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(Copy)"}},
            {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    kernels = [{"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": 100.0, "name": "k"}
               for tid, ts in ((7, 0), (8, 300), (7, 1000))]
    summary = [{"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 1100.0, "name": "op"}]  # not a stream: not busy
    host = [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 1200.0, "name": "step"},
            {"ph": "X", "pid": 1, "tid": 1, "ts": 350, "dur": 600.0, "name": "launch"},
            {"ph": "X", "pid": 1, "tid": 1, "ts": 500, "dur": 100.0, "name": "update"},
            {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 150.0, "name": "wait"}]
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": meta + kernels + summary + host}, handle)
    causes = [(cause.thread, cause.name, round(cause.seconds * 1e6)) for cause in idle_causes(tmp_path)]
    assert causes == [("engine", "launch", 450), ("engine", "step", 250), ("engine", "update", 100),
                      ("waiter", "wait", 50)]
    assert [cause.name for cause in idle_causes(tmp_path, min_gap_s=300e-6)] == ["launch", "update", "step"]
