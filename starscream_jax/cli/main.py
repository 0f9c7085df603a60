"""The `starscream` command: topology, train, generate, serve, export, inspect, plan.

Importing JAX (as every module here does) does not start its backend: `prepare_simulation` decides the devices (the
simulated CPU mesh, or the GPUs JAX finds) after the arguments are read and before anything touches a device.
"""
from __future__ import annotations

import argparse
import os
import select
import sys

from ..errors import RunStopped, StarscreamError
from . import export, generate, inspect, plan, serve, topology, train
from .arguments import EXCLUSIVE, explicit_options, option_names, prepare_simulation, refuse_contradictions

SUBCOMMANDS = {
    "topology": (topology, "print the topology and which device sits at each (gpu, xcd)"),
    "train": (train, "train a model under a layout (default: tiny Llama, simulated 2 x 4 mesh)"),
    "generate": (generate, "generate text from a checkpoint with prefill and decode layouts"),
    "serve": (serve, "serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache)"),
    "export": (export, "write a training run's parameters as a Hugging Face model directory"),
    "inspect": (inspect, "compile layouts side by side and check the three principles"),
    "plan": (plan, "choose a layout per phase with the cost model"),
}
"""name -> (module with add_arguments(parser), run(args) -> exit code and optionally EXCLUSIVE: pairs of its flags
that contradict each other, one-line help)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="starscream", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(run=module.run)
        module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        module = SUBCOMMANDS[args.command][0]
        refuse_contradictions(explicit_options(build_parser(), argv), EXCLUSIVE + getattr(module, "EXCLUSIVE", ()),
                              option_names(parser))
        prepare_simulation(args)
        status = args.run(args)
        sys.stdout.flush()  # a reader that left shows here, in the handler below, not at the interpreter's exit
        return status
    except RunStopped as stopped:
        print(f"starscream {args.command}: {stopped}", file=sys.stderr)
        return stopped.exit_status
    except StarscreamError as err:
        print(f"starscream {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a run's own handling (train's steps stop at a checkpoint: RunStopped)
        kept = "; checkpoints written before it are kept (--resume continues from the newest)" \
            if args.command == "train" else ""
        print(f"starscream {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`starscream topology | head`): stop quietly, as cat does
        if not _stdout_reader_left():
            raise  # another pipe broke (an engine process gone, say): not for this handler to hide
        _drop_stdout()
        return 141  # 128 + SIGPIPE, the status a shell gives a command killed by a closed pipe


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on such a writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # stdout closed, or not a file (a test's capture)
        return False


def _drop_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's flush at exit finds no closed pipe to raise on again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout already closed, or not a file (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())
