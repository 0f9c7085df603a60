"""The compiled program, read and judged: compiling the steps from abstract arguments (`compile`), the HLO and
StableHLO readers (`hlo`, `stablehlo`), the per-device report (`report`), the three principles (`principles`), one
layout's full result (`layout_report`), the cost model (`costmodel`) and the planner (`plan`)."""
