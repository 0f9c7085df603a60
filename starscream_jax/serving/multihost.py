"""Serving over a mesh that spans processes: one process schedules, every process runs the same steps.

Each process builds the same `Engine` over the same global mesh (the parameters and page pools are global arrays, each
process holding its devices' shards). Process 0, the leader, runs the scheduler, the server and everything per request;
before each compiled step it broadcasts the step's host inputs (`steps.StepInputs`: tokens, positions, block tables,
last indices, sampling, numpy arrays of the bucket's shapes; a mixed step's two, `steps.MixedInputs`) to the others with
`jax.experimental.multihost_utils.broadcast_one_to_all`, first a fixed-size header naming the phase and the bucket
(`buckets.Bucket`), then the arrays. The other processes, followers, run `follow(engine)`: receive a step, run the same
compiled program on the same inputs, repeat until the leader's stop (an idle leader sends a header without a step every
few seconds, so no follower waits in a collective long enough to time out). The sampled tokens are gathered to every
process (`process_allgather`) so that the leader reads them all. Nothing per request leaves the leader: the followers
hold no scheduler state, only the pools, which every step updates alike on every process.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from .sampling import SlotReset
from .buckets import Bucket
from .steps import PHASES, MixedInputs, StepInputs

STOP, IDLE, RESET, MASKS = -1, -2, -3, -4
"""The header's phase index that ends `follow`, the one of a leader idle but alive (no step follows), the one of
a slot's new state (`sampling.SlotReset`, written before the step that reads it) and the one of guided rows'
grammar masks (`Engine.write_masks`, likewise)."""
HEADER = 5
"""Numbers in a header: the phase's index (or one of the above), then a step's `buckets.Bucket` without its phase."""


class StepBroadcast:
    """The leader's step inputs shared with every process (see the module docstring); `leader` is process 0."""

    def __init__(self):
        self.leader = jax.process_index() == 0

    def send(self, phase: str, inputs: StepInputs | MixedInputs) -> None:
        """Leader: announce the step of `phase` over `inputs` (host arrays) to the followers."""
        self._header(np.array([PHASES.index(phase), *Bucket.of(phase, inputs)[1:]], np.int32))
        multihost_utils.broadcast_one_to_all(inputs, is_source=True)

    def send_reset(self, reset: SlotReset) -> None:
        """Leader: announce a slot's new state (`Engine.reset_slot`), before the step that first reads it."""
        self._header(np.array([RESET, reset.counts.shape[0], 0, 0, 0], np.int32))
        multihost_utils.broadcast_one_to_all(reset, is_source=True)

    def send_masks(self, slots: np.ndarray, masks: np.ndarray) -> None:
        """Leader: announce grammar masks [K, W] for slots [K] (`Engine.write_masks`), before the step that reads
        them."""
        self._header(np.array([MASKS, *masks.shape, 0, 0], np.int32))
        multihost_utils.broadcast_one_to_all((slots, masks), is_source=True)

    def stop(self) -> None:
        """Leader: end every follower's loop."""
        self._header(np.array([STOP, 0, 0, 0, 0], np.int32))

    def idle(self) -> None:
        """Leader: no step yet, still alive (keeps the followers' wait in the broadcast short of its timeout)."""
        self._header(np.array([IDLE, 0, 0, 0, 0], np.int32))

    def receive(self) -> tuple[str, StepInputs | MixedInputs | SlotReset | tuple] | None:
        """Follower: the next step's (phase, host inputs), a slot's ("reset", SlotReset), grammar masks ("masks",
        (slots [K], masks [K, W])), or None once the leader stops."""
        phase = IDLE
        while phase == IDLE:
            phase, rows, width, pages, chunks = (int(value) for value in self._header(np.zeros(HEADER, np.int32)))
        if phase == STOP:
            return None
        if phase == RESET:
            reset = multihost_utils.broadcast_one_to_all(SlotReset.of(-1, rows, [], []), is_source=False)
            return "reset", jax.tree.map(np.asarray, reset)
        if phase == MASKS:  # (rows: the slots, width: the words of a mask)
            empty = (np.zeros(rows, np.int32), np.zeros((rows, width), np.int32))
            return "masks", jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(empty, is_source=False))
        empty = Bucket(PHASES[phase], rows, width, pages, chunks).zeros()
        inputs = multihost_utils.broadcast_one_to_all(empty, is_source=False)
        return PHASES[phase], jax.tree.map(np.asarray, inputs)

    def _header(self, header):
        return np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=self.leader))


def follow(engine) -> int:
    """Follower: run the leader's steps (and slot resets and grammar masks) on this process' devices until it
    stops; returns the steps run."""
    steps = 0
    while (message := engine.channel.receive()) is not None:
        phase, inputs = message
        if phase == "reset":
            engine.reset_slot(inputs)
            continue
        if phase == "masks":
            engine.write_masks(*inputs)
            continue
        engine.execute(phase, inputs)
        steps += 1
    return steps
