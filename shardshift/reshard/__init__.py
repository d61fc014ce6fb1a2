"""The virtual parameter space and the layout switch's planner and executor.

`space`: logical tensors, boxes, and the rule that places them (a `StateSpace`); `plan`: which box
goes from which process to which (`plan_transition`); `schedule`: the plan cut into rounds under a
memory budget (`build_schedule`); `execute`: one process's program of the rounds, run over a
`shardshift.comm.Transport`. All but the executor are pure metadata, usable with no process group.
"""

from shardshift._exports import lazy_exports

_NAMES = {
    "Box": ".space", "LogicalTensor": ".space", "StateSpace": ".space", "holding": ".space",
    "Assignment": ".plan", "TransitionPlan": ".plan", "plan_transition": ".plan",
    "SwitchSchedule": ".schedule", "build_schedule": ".schedule",
    "SwitchProgram": ".execute", "compile_program": ".execute", "run_program": ".execute",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
