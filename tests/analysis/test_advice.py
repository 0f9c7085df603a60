"""The smallest fix for each flat collective, read from the primitive whose partitioning emitted it."""
import dataclasses

from starscream_jax.analysis.advice import advise, advise_batch
from starscream_jax.analysis.report import CollectiveReport, InputReport, Report
from starscream_jax.sharding.layouts import get_layout

TP = get_layout("starscream_tp")


def collective(name: str, op_name: str, scope: str = "flat") -> CollectiveReport:
    return CollectiveReport(name=name, kind="all-reduce", op_name=op_name, scope=scope, groups=[[0, 1, 2, 3]],
                            group_size=4, buffer_bytes=64, bytes_per_device=48.0, count=1)


def report_of(*collectives: CollectiveReport) -> Report:
    fields = {field.name: None for field in dataclasses.fields(Report)}
    return dataclasses.replace(Report(**fields), collectives=list(collectives))


def test_a_flat_lookup_asks_for_embed_lookup_and_a_flat_gradient_sum_for_the_explicit_path():
    found = advise(report_of(collective("cp", "jit(step)/jvp(jit(_take))/gather"),
                             collective("ar", "jit(step)/transpose(jvp())/reduce_sum"),
                             collective("ok", "jit(step)/transpose(jvp())/reduce_sum", scope="intra_gpu"),
                             collective("other", "jit(step)/jvp()/reduce_max")), TP, auto_axes=True)
    assert [(advice.name, advice.fix.split(";")[0]) for advice in found] == [
        ("cp", "look the tokens up with embed_lookup(table, tokens)"), ("ar", "on Auto axes XLA chooses this sum")]
    explicit = advise(report_of(collective("ar", "jit(step)/transpose(jvp())/dot_general")), TP, auto_axes=False)
    assert explicit[0].fix.startswith("weights_at_use(model) in the loss")


def test_under_a_flat_layout_the_layout_is_the_cause():
    report = report_of(collective("cp", "jit(step)/jvp(jit(_take))/gather"), collective("ar", "jit(step)/jvp()/x"))
    assert [(a.name, a.why) for a in advise(report, get_layout("flat_tp"), auto_axes=False)] == [
        ("2 flat collectives", "layout flat_tp splits weights over partitions of several GPUs at once")]
    assert advise(report_of(), get_layout("flat_fsdp"), auto_axes=False) == ()


def token_input(name: str, dtype: str, shape: list[int], replication_xcd: int) -> InputReport:
    return InputReport(name=name, shape=shape, dtype=dtype, spec=None, bytes=4 * shape[0] * shape[1],
                       shard_bytes=4 * shape[0] * shape[1], replication_xcd=replication_xcd, replication_gpu=2)


def test_a_token_batch_nothing_splits_is_placed_by_batch_sharding():
    """An int [8, 9] batch whole on the 4 partitions of each GPU while the matmuls work on 64 tokens per device
    (starscream_tp splits the batch 4 ways, so at most 18) gets the one-line fix; the same batch split by the step
    (16 tokens per device), a float input, a layout that splits no batch over xcd and a batch already split do not."""
    report = dataclasses.replace(report_of(), mesh_axes={"data": 1, "gpu": 2, "xcd": 4}, tokens_per_device=64,
                                 inputs=[token_input("2", "int32", [8, 9], 4), token_input("x", "float32", [8, 9], 4),
                                         token_input("3", "int32", [8, 9], 1)])
    found = advise_batch(report, TP)
    assert [advice.name for advice in found] == ["2"]
    assert found[0].fix.endswith("tokens = jax.device_put(tokens, starscream_jax.batch_sharding(layout, mesh))")
    assert "64 tokens per device, where starscream_tp splits the batch 4 ways (data x xcd)" in found[0].why
    assert advise_batch(dataclasses.replace(report, tokens_per_device=16), TP) == ()
    assert advise_batch(report, get_layout("gpu_tp")) == ()
