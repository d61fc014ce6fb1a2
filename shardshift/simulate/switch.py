"""`simulate_switch`: a switch planned, scheduled and timed for a world no machine here has.

It runs the very code a real switch runs — `plan_transition` (the rank assignment included) and
`build_schedule` — on the logical tensors of a model (`SpecSpace` from a published config, or a built-in model's
space, derived from its `ModelSpec`), with no tensor and no process, and times the schedule on an α–β model
of a cluster (`cluster.predict`). What it reports is what `shardshift simulate switch` prints.
"""

from __future__ import annotations

import dataclasses
import resource
import time

from shardshift.layout import Layout
from shardshift.reshard.execute import calls_per_rank
from shardshift.reshard.plan import Assignment, TransitionPlan, plan_transition
from shardshift.reshard.schedule import DEFAULT_BUDGET, SwitchSchedule, build_schedule
from shardshift.simulate.cluster import Cluster, Prediction, predict


def model_space(model: str, dtype: str = "float32"):
    """The state space of `model`: a model `shardshift train` takes (built in, ``hf:DIR``, or
    ``FILE.py:NAME``) through its `ModelSpec`, a shipped spec (`simulate.specs`) or a config file
    (YAML, or a Hugging Face config.json)."""
    from shardshift.models import model_spec, names_a_model
    from shardshift.train.config import DTYPES, torch_dtype

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if names_a_model(model):
        from shardshift.models.space import state_space

        return state_space(model_spec(model), torch_dtype(dtype))
    from shardshift.simulate.space import SpecSpace
    from shardshift.simulate.specs import load_spec

    return SpecSpace(load_spec(model), torch_dtype(dtype))


@dataclasses.dataclass(frozen=True)
class SwitchSimulation:
    plan: TransitionPlan
    schedule: SwitchSchedule
    prediction: Prediction
    cluster: Cluster
    plan_seconds: float
    schedule_seconds: float
    predict_seconds: float

    def report(self) -> dict:
        plan, pred = self.plan, self.prediction
        calls = calls_per_rank(self.schedule)  # the most of any rank; piece by piece and coalesced
        return {
            "from": str(plan.old.layout), "to": str(plan.new.layout), "ranks": plan.world_size,
            "tensors": len(plan.tensors), "new_ranks_order": "identity" if plan.new.ranks == tuple(
                range(len(plan.new.ranks))) else "permuted",
            "bytes_total": plan.bytes_total, "bytes_moved": plan.bytes_moved, "bytes_kept": plan.bytes_kept,
            "bytes_lower_bound": plan.bytes_lower_bound, "most_received_bytes": int(plan.received.max(initial=0)),
            "most_sent_bytes": int(plan.sent.max(initial=0)),
            "rounds": len(self.schedule.pieces), "budget_bytes": self.schedule.budget,
            "pieces_per_rank": int(calls.pieces.max(initial=0)),
            "host_calls_per_rank_before": int(calls.before.max(initial=0)),
            "host_calls_per_rank": int(calls.after.max(initial=0)),
            "peak_extra_bytes": int(self.schedule.peaks.max(initial=0)),
            "intra_host_bytes": pred.intra_host_bytes, "inter_host_bytes": pred.inter_host_bytes,
            "busiest_nic_bytes": pred.busiest_nic_bytes, "largest_local_copy_bytes": pred.copy_bytes,
            "predicted_seconds": pred.seconds, "limit_seconds": pred.limit_seconds, "cluster": self.cluster.describe(),
            "plan_seconds": self.plan_seconds, "schedule_seconds": self.schedule_seconds,
            "predict_seconds": self.predict_seconds, "max_rss_bytes": _max_rss(),
        }


def simulate_switch(space, old: Layout, new: Layout, cluster: Cluster, budget: int = DEFAULT_BUDGET,
                    memory_per_rank: int | None = None, ranks: tuple[int, ...] | None = None) -> SwitchSimulation:
    """Plan, schedule and time the switch from `old` (on processes in rank order) to `new`.

    Raises ValueError before planning when a layout does not suit the model or the world, or (with
    `memory_per_rank`) when a layout's state does not fit."""
    if old.world_size != new.world_size:
        raise ValueError(f"--from {old} has {old.world_size} ranks and --to {new} has {new.world_size}; "
                         f"a switch keeps the world (give layouts of one size)")
    for flag, layout in (("--from", old), ("--to", new)):
        try:
            space.check(layout)
            if memory_per_rank is not None:
                from shardshift.simulate.space import check_memory

                check_memory(space, layout, memory_per_rank)
        except ValueError as err:
            raise ValueError(f"{flag} {layout}: {err}") from None
    import scipy.optimize  # noqa: F401 - loaded before the clock starts: a process pays it once, not per plan

    started = time.perf_counter()
    plan = plan_transition(space, Assignment.identity(old), new, ranks=ranks)
    planned = time.perf_counter()
    schedule = build_schedule(plan, budget, validate=plan.world_size <= 64)
    scheduled = time.perf_counter()
    prediction = predict(schedule, cluster)
    return SwitchSimulation(plan, schedule, prediction, cluster, planned - started, scheduled - planned,
                            time.perf_counter() - scheduled)


def _max_rss() -> int:
    """The most resident memory this process has used, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
