"""What a Flax model placed by plain rules gives up without `weights_at_use`: bytes on the compiled train step.

The transformer of examples/flax_nnx_model.py (Flax's own layers, MaxText's names) is compiled under starscream_tp
twice on each mesh, from the same sharded model and optimizer: once with the loss taking the weights through
`weights_at_use` (the gather inside the GPU and the two-stage gradient reduction), once with the model called as it
is (the rules alone: the parameters stored as the layout stores them, JAX's sharding propagation choosing how to use
them and how to reduce their gradients). For each it prints `check`'s figures: compiled temporaries per device,
collective bytes per device inside GPUs and over inter-GPU links (flat collectives included, as `starscream inspect`
counts them), and the three verdicts; then the ratios of the plain program's bytes to the gathered one's.

    python scripts/measure_weights_at_use.py [--d-model 512 --d-ff 2048 --heads 8 --layers 2 --batch 16 --seq 256]
    python scripts/measure_weights_at_use.py --out weights_at_use.json    # and the figures as JSON
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import jax
import optax
from flax import nnx

from starscream_jax import MAXTEXT, build_mesh, check, create_sharded, in_vocabulary, simulate_cpu_devices, use_layout
from starscream_jax.analysis.format import format_bytes
from starscream_jax.benchmarks import harness

MESHES = {"1x2x4": (1, 2, 4), "2x2x2": (2, 2, 2), "2x4x8": (2, 4, 8)}
"""(data, gpu, xcd): one data group of 2 GPUs x 4 partitions; two groups of 2 GPUs x 2; two of 4 GPUs x 8."""
EXAMPLE = Path(__file__).parents[1] / "examples" / "flax_nnx_model.py"


def load_example():
    spec = importlib.util.spec_from_file_location("flax_nnx_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def steps(example):
    """{"gathered": the example's train step, "plain": the same step with the model called as it is}."""
    def plain_loss(model, tokens_BS):
        tokens_BS = example.constrain(tokens_BS, example.TOKENS)
        return example.next_token_loss(model(tokens_BS[:, :-1]), tokens_BS)

    def plain_step(model, optimizer, tokens_BS):
        loss, grads = nnx.value_and_grad(plain_loss)(model, tokens_BS)
        optimizer.update(model, grads)
        return loss

    return {"gathered": nnx.jit(example.train_step), "plain": nnx.jit(plain_step)}


def measure(example, mesh_name: str, args) -> dict:
    data, gpu, xcd = MESHES[mesh_name]
    mesh = build_mesh(f"{data * gpu}x{xcd}", data=data)
    layout = in_vocabulary("starscream_tp", MAXTEXT)
    model = create_sharded(lambda: example.Transformer(
        vocab=args.vocab, d_model=args.d_model, heads=args.heads, head_dim=args.d_model // args.heads,
        d_ff=args.d_ff, layers=args.layers, rngs=nnx.Rngs(0)), layout, mesh)
    tokens = example.batches(0, batch=args.batch, seq=args.seq + 1, vocab=args.vocab)
    results = {}
    with use_layout(layout, mesh):
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        for name, step in steps(example).items():
            results[name] = check(step, model, optimizer, tokens, mesh=mesh, vocabulary=MAXTEXT)
    return results


def link_bytes(result) -> dict[str, float]:
    """Bytes per device per step as `starscream inspect` counts them: inter-GPU includes the flat collectives' (a flat
    ring passes every byte over inter-GPU links)."""
    sent = result.report.bytes_by_scope()
    return {"intra_gpu": sent["intra_gpu"], "inter_gpu": sent["inter_gpu"] + sent["inter_node"] + sent["flat"],
            "flat": sent["flat"]}


def row(name: str, result) -> str:
    sent = link_bytes(result)
    memory = result.report.memory
    verdicts = "/".join("ok" if v.ok else "FAIL" for _, v in result.principles.verdicts())
    return (f"  {name:<9} intra-GPU {format_bytes(sent['intra_gpu']):>10}  "
            f"inter-GPU {format_bytes(sent['inter_gpu']):>10}  of which flat {format_bytes(sent['flat']):>10}  "
            f"temp {format_bytes(memory.temp_bytes):>10}  "
            f"principles {verdicts}")


def figures(result) -> dict:
    """What `row` prints, as numbers: collective bytes per device by link, compiled temporaries, the verdicts."""
    return {**link_bytes(result), "temp_bytes": result.report.memory.temp_bytes,
            "principles": {name: verdict.ok for name, verdict in result.principles.verdicts()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--meshes", default="1x2x4,2x2x2,2x4x8", help="comma-separated (data)x(gpu)x(xcd) names")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here (rewritten after every mesh)")
    args = parser.parse_args(argv)
    simulate_cpu_devices(64)
    example = load_example()
    output = {"meta": harness.run_info(__file__, argv).as_dict(), "meshes": {}}
    for mesh_name in args.meshes.split(","):
        results = measure(example, mesh_name, args)
        output["meshes"][mesh_name] = {name: figures(result) for name, result in results.items()}
        harness.write_json(args.out, output)
        print(f"mesh {mesh_name} (data x gpu x xcd), train step, collective bytes per device per step:")
        for name, result in results.items():
            print(row(name, result))
        gathered, plain = (link_bytes(results[n]) for n in ("gathered", "plain"))
        for scope in ("intra_gpu", "inter_gpu", "flat"):
            if gathered[scope]:
                print(f"  plain / gathered, {scope}: {plain[scope] / gathered[scope]:.2f}x")
        for name, result in results.items():
            for principle, verdict in result.principles.verdicts():
                for line in verdict.violations[:2]:
                    print(f"  {name} {principle}: {line[:150]}")
    print(f"jax {jax.__version__}, CPU backend (reduce-scatters print as all-reduce + slice; bytes up to 2x a GPU's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
