"""`shardshift simulate switch`: the plan and schedule of a real switch, at any size, timed on an α–β
cluster model; large plans validated like small ones on sampled tensors and ranks; refusals before
planning."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from shardshift.cli.main import main
from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.models.space import state_space
from shardshift.reshard.execute import compile_program
from shardshift.reshard.plan import Assignment, plan_transition
from shardshift.reshard.schedule import build_schedule
from shardshift.simulate.cluster import Cluster, cluster_from_dict, load_cluster, predict
from shardshift.simulate.host_memory import HostMemory, PageRates, page_work
from shardshift.simulate.space import SpecSpace
from shardshift.simulate.specs import DecoderSpec
from shardshift.simulate.switch import model_space, simulate_switch
from shardshift.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
# A mixture-of-experts model small enough to list every segment of a 256-rank switch.
MOE = SpecSpace(DecoderSpec(name="small-moe", hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=4, intermediate_size=96, vocab_size=100, num_experts=16,
                          num_experts_per_tok=2, moe_intermediate_size=32, qk_norm=True))


@pytest.mark.parametrize("old, new", [("dp=4", "fsdp=4"), ("fsdp=2,tp=2", "tp=2,pp=2"), ("pp=4", "dp=2,fsdp=2")])
def test_a_simulated_four_rank_switch_is_the_plan_and_schedule_a_real_switch_runs(old, new):
    cfg = TrainConfig(layout=Layout.parse(old), model=model_spec("test"), steps=1)
    real = plan_transition(state_space(cfg.model, cfg.param_dtype), Assignment.identity(cfg.layout), Layout.parse(new))
    sim = simulate_switch(model_space("test"), cfg.layout, Layout.parse(new), Cluster(hosts=1, gpus_per_host=4))
    assert sim.plan.segments == real.segments and sim.plan.new == real.new
    assert sim.schedule.rounds == build_schedule(real).rounds
    report = sim.report()
    assert report["bytes_moved"] == report["bytes_lower_bound"] == real.bytes_moved
    assert report["bytes_kept"] == real.bytes_kept and report["rounds"] == len(sim.schedule.rounds)


def _check_sampled(plan, tensors) -> None:
    """Brute force on some tensors: every process's new box is tiled exactly by its segments, each
    inside its source's old box."""
    for t in tensors:
        segs = [s for s in plan.segments if s.tensor == t]
        for rank in range(plan.world_size):
            need = plan.new_box(rank, t)
            mine = [s for s in segs if s.dst == rank]
            if need is None or need.empty:
                assert not mine
                continue
            assert sum(s.box.numel for s in mine) == need.numel
            for i, s in enumerate(mine):
                assert need.contains(s.box) and plan.source_box(s).contains(s.box)
                assert all(s.box.intersect(o.box).empty for o in mine[i + 1:])


@pytest.mark.parametrize("old, new", [("dp=2,fsdp=2,ep=8,tp=4,pp=2", "dp=4,ep=4,tp=4,pp=4"),
                                      ("fsdp=4,ep=16,tp=2,pp=2", "dp=2,fsdp=2,ep=8,tp=4,pp=2")])
def test_a_256_rank_moe_switch_is_valid_on_sampled_tensors_and_ranks(old, new):
    plan = plan_transition(MOE, Assignment.identity(Layout.parse(old)), Layout.parse(new))
    rng = random.Random(0)
    _check_sampled(plan, rng.sample(range(len(plan.tensors)), 12))
    schedule = build_schedule(plan, 64 << 10, validate=False)
    schedule.validate(ranks=rng.sample(range(plan.world_size), 8))  # the budget rule, rank by rank
    assert len(schedule.pieces) > 1 and plan.bytes_moved == plan.bytes_lower_bound > 0


def test_the_alpha_beta_model_times_a_round_by_its_busiest_gpu_and_nic():
    # Two hosts of two GPUs: fsdp=4 -> dp=4 sends each quarter to the three others, two of them
    # on the other host through one NIC per host.
    cluster = Cluster(hosts=2, gpus_per_host=2, nics_per_host=1, intra_bandwidth=4e9, nic_bandwidth=1e9,
                      intra_latency=0.0, latency=0.0, copy_bandwidth=1e18)
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    sim = simulate_switch(space, Layout(fsdp=4), Layout(dp=4), cluster, budget=1 << 40)
    quarter = sim.plan.received[0] // 3  # a rank's quarter of the state, arriving from each of 3 peers
    assert len(sim.schedule.pieces) == 1
    # Each NIC carries 2 GPUs x 2 remote quarters out: 4 quarters at 1 GB/s, the slowest resource.
    assert sim.prediction.busiest_nic_bytes == pytest.approx(4 * quarter, rel=0.01)
    assert sim.prediction.seconds == pytest.approx(4 * quarter / 1e9, rel=0.01)
    assert sim.report()["inter_host_bytes"] == pytest.approx(8 * quarter, rel=0.01)


def test_a_host_moves_at_most_its_own_bandwidth():
    # One host of four GPUs whose switch carries 4 GB/s in all: fsdp=4 -> dp=4 moves 12 quarters
    # inside it, so the switch, not a GPU's port (3 quarters each), decides.
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    free = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=4e9, intra_latency=0.0, copy_bandwidth=1e18)
    shared = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=4e9, host_bandwidth=4e9, intra_latency=0.0,
                     copy_bandwidth=1e18)
    times = [simulate_switch(space, Layout(fsdp=4), Layout(dp=4), c, budget=1 << 40).prediction for c in (free, shared)]
    assert times[1].seconds == pytest.approx(4 * times[0].seconds, rel=0.01)  # 12 quarters at 4 GB/s vs 3
    assert times[1].limit_seconds == pytest.approx(times[1].seconds, rel=0.01)


def test_a_cpu_host_s_rank_passes_its_bytes_in_and_out_together():
    # fsdp=4 -> dp=4: every rank sends its quarter to three peers and takes three quarters in. A
    # GPU's port moves both at once (3 quarters' time); a CPU rank's process handles both ends on
    # the cores (6 quarters' time at the same rate), the host's cores and links set free here.
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    gpus = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=4e9, intra_latency=0.0, copy_bandwidth=1e18)
    cpu = dataclasses.replace(gpus, host_cores=1 << 20)
    sims = [simulate_switch(space, Layout(fsdp=4), Layout(dp=4), c, budget=1 << 40) for c in (gpus, cpu)]
    quarter = sims[0].plan.received[0] // 3
    assert len(sims[0].schedule.pieces) == 1
    assert sims[0].prediction.seconds == pytest.approx(3 * quarter / 4e9, rel=0.01)
    assert sims[1].prediction.seconds == pytest.approx(6 * quarter / 4e9, rel=0.01)


def test_copies_take_turns_on_a_cpu_host_s_cores_and_a_whole_piece_kept_costs_none():
    # dp=4 -> fsdp=4 only copies: each rank a quarter of its replica. On 2 cores shared by 4 ranks
    # the copies take twice as long as on 4 GPUs copying apart; fsdp=2,tp=2 -> itself keeps
    # every piece whole, which is handed over.
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    apart = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=4e9, intra_latency=0.0, copy_bandwidth=1e9)
    cores = dataclasses.replace(apart, host_cores=2)
    sims = [simulate_switch(space, Layout(dp=4), Layout(fsdp=4), c, budget=1 << 40) for c in (apart, cores)]
    assert sims[0].plan.bytes_moved == 0
    # Apart: a rank's own copies (pieces kept whole cost none); on the cores: the
    # four ranks' copies, two at a time.
    assert 0 < sims[0].prediction.copy_bytes * 4 < sims[0].plan.bytes_kept
    assert sims[0].prediction.seconds == pytest.approx(sims[0].prediction.copy_bytes / 1e9, rel=0.01)
    assert sims[1].prediction.seconds == pytest.approx(2 * sims[0].prediction.seconds, rel=0.01)
    same = simulate_switch(space, Layout(fsdp=2, tp=2), Layout(fsdp=2, tp=2), cores, budget=1 << 40)
    assert same.plan.bytes_kept > 0 and same.prediction.seconds == 0
    with pytest.raises(ValueError, match="host_cores"):
        Cluster(host_cores=-1)


def test_each_end_of_a_piece_costs_the_host_its_handling():
    # With copies and links free, a switch costs only its pieces' handling: dp=4 -> fsdp=4 copies
    # one piece of each tensor a rank; fsdp=4 -> dp=4 has each rank cut its quarter of a sharded
    # tensor out for three peers and fill three quarters from them beside its own.
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    free = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=1e18, intra_latency=0.0, copy_bandwidth=1e18)
    handled = dataclasses.replace(free, piece_seconds=1e-3)
    unhandled, local = (simulate_switch(space, Layout(dp=4), Layout(fsdp=4), c, budget=1 << 40).prediction.seconds
                        for c in (free, handled))
    assert unhandled < 1e-9 and local == pytest.approx(1e-3 * len(space.tensors), rel=0.01)
    spread = simulate_switch(space, Layout(fsdp=4), Layout(dp=4), handled, budget=1 << 40)
    (pieces,) = spread.schedule.pieces
    ends = np.zeros(4)
    for piece in pieces:
        src, dst = piece.flow.src, piece.flow.dst
        np.add.at(ends, src[src != dst], 1)  # cut out for a peer
        np.add.at(ends, dst, 1)  # filled, from a peer or from its own old piece
    assert ends.max() > 5 * len(space.tensors)  # 7 ends for each sharded tensor, 1 for a replicated one
    assert spread.prediction.seconds == pytest.approx(1e-3 * ends.max(), rel=0.01)
    with pytest.raises(ValueError, match="piece_seconds"):
        Cluster(piece_seconds=-1.0)


def test_a_cpu_host_books_each_message_end_and_the_freeing_of_old_pieces_on_its_cores():
    # Links, copies and pieces free: what is left is the host's processor time for each message
    # end and for the old pieces freed (not the bytes of a piece kept whole: they become the new
    # piece), all ranks' on the host's two cores. The expected figures come from the executor's
    # own program of each rank, not from the model.
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    free = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=1e18, intra_latency=0.0, copy_bandwidth=1e18, host_cores=2)
    messages = dataclasses.replace(free, message_host_seconds=1e-3)
    freeing = PageRates(free_bandwidth=1e6)  # with no `HostMemory`, every old piece goes back to the kernel

    def program_totals(sim):
        ends = freed = 0
        for rank in range(4):
            program = compile_program(sim.schedule, rank)
            for step in program.rounds:
                ends += len(step.sends) + len(step.recvs)
                freed += sum(nbytes for _, nbytes in step.closes)
                freed -= sum(sim.plan.piece_bytes(sim.plan.new_boxes, rank, c.tensor) for c in step.copies if c.whole)
        return ends, freed

    spread = simulate_switch(space, Layout(fsdp=4), Layout(dp=4), messages, budget=1 << 40)
    ends, _ = program_totals(spread)
    assert ends > 0 and spread.prediction.seconds == pytest.approx(1e-3 * ends / 2, rel=0.01)
    assert simulate_switch(space, Layout(fsdp=4), Layout(dp=4), free, budget=1 << 40).prediction.seconds < 1e-9
    # No message: every rank frees its replica, but for the pieces it keeps whole (norms stay replicated under tp).
    shard = simulate_switch(space, Layout(dp=4), Layout(tp=4), free, budget=1 << 40)
    ends, freed = program_totals(shard)
    kept = [c for step in compile_program(shard.schedule, 0).rounds for c in step.copies if c.whole]
    assert ends == 0 and kept and 0 < freed < 4 * shard.plan.held_bytes(shard.plan.old_boxes, 0)
    work = page_work(shard.schedule, freeing)
    assert predict(shard.schedule, free, work.seconds).seconds == pytest.approx(freed / 1e6 / 2, rel=0.01)
    # GPUs (no host_cores) book neither: their transport and caching allocator do not take the host's cores.
    gpus = dataclasses.replace(messages, host_cores=0)
    assert simulate_switch(space, Layout(dp=4), Layout(fsdp=4), gpus, budget=1 << 40).prediction.seconds < 1e-9
    with pytest.raises(ValueError, match="host_cores=0"):
        predict(shard.schedule, gpus, work.seconds)
    # A cluster with more hosts than the job fills (8 ranks on 2 of its 3 hosts) books them alike.
    roomy = dataclasses.replace(messages, hosts=3)
    spread = simulate_switch(space, Layout(fsdp=8), Layout(dp=2, fsdp=4), roomy, budget=1 << 40)
    assert spread.prediction.seconds > 0
    pages = page_work(spread.schedule, freeing).seconds
    assert predict(spread.schedule, roomy, pages).seconds > spread.prediction.seconds
    with pytest.raises(ValueError, match="message_host_seconds"):
        Cluster(message_host_seconds=-1.0)
    with pytest.raises(ValueError, match="free_bandwidth"):
        PageRates(free_bandwidth=-1.0)


def _allocator_replay(schedule, rank: int, room: float, share: float) -> tuple[float, float]:
    """(fresh, unmapped) bytes of `rank`, from the executor's own program of the switch: its new
    pieces opened and old pieces closed round by round, but those it keeps whole (handed over)."""
    program = compile_program(schedule, rank)
    kept = {c.tensor for step in program.rounds for c in step.copies if c.whole}
    fresh = unmapped = 0.0
    for step in program.rounds:
        opened = sum(nbytes for t, nbytes, _ in step.opens if t not in kept)
        freed = sum(nbytes for t, nbytes in step.closes if t not in kept)
        fresh += max(opened - room, 0.0)
        unmapped += freed * share
        room = max(room - opened, 0.0) + freed * (1 - share)
    return fresh, unmapped


def test_a_cpu_host_writes_new_pieces_on_fresh_pages_beyond_the_room_its_allocator_holds():
    # Links, copies and messages free: what is left is the kernel's work on pages, on the host's
    # two cores. Each rank's allocator starts with some free memory; a new piece takes it while
    # it lasts and fresh pages beyond; old pieces freed go back to the kernel at the mapped-apart
    # share, the rest is room for the next rounds' pieces. Expected from the executor's programs.
    space = SpecSpace(DecoderSpec(name="d", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, vocab_size=64))
    free = Cluster(hosts=1, gpus_per_host=4, intra_bandwidth=1e18, intra_latency=0.0, copy_bandwidth=1e18, host_cores=2)
    rates = PageRates(fresh_page_bandwidth=1e6, free_bandwidth=4e6)
    sim = simulate_switch(space, Layout(fsdp=2, tp=2), Layout(dp=2, fsdp=2), free, budget=8 << 10)

    def booked(memory: HostMemory, rates: PageRates = rates, cluster: Cluster = free):
        work = page_work(sim.schedule, rates, memory)
        return work, predict(sim.schedule, cluster, work.seconds).seconds

    assert len(sim.schedule.pieces) > 3  # rounds enough for what one frees to be room for the next
    new_bytes = [sim.plan.held_bytes(sim.plan.new_boxes, r) for r in range(4)]
    for room, share in ((0.0, 1.0), (new_bytes[0] / 3, 0.0), (new_bytes[0] / 3, 0.5), (10 * max(new_bytes), 0.5)):
        expected = np.array([_allocator_replay(sim.schedule, r, room, share) for r in range(4)])
        work, seconds = booked(HostMemory(room, share))
        assert work.fresh_bytes == pytest.approx(expected[:, 0].sum(), abs=4)
        assert work.unmapped_bytes == pytest.approx(expected[:, 1].sum(), abs=4)
        # One host: every round's work on pages, all ranks', takes turns on its two cores.
        cores = (expected[:, 0] / 1e6 + expected[:, 1] / 4e6).sum() / 2
        assert cores > 0 and seconds == pytest.approx(cores, rel=1e-6)
    # Not vacuous: room that lasts saves fresh pages, and what the first rounds free (share 0) is reused.
    none, some = (booked(HostMemory(room, 0.0))[0].fresh_bytes for room in (0.0, new_bytes[0] / 3))
    assert 0 < some < none < sum(new_bytes)
    # Per process, in rank order: only rank 2 has room.
    roomy = 10.0 * max(new_bytes)
    lopsided, _ = booked(HostMemory((0.0, 0.0, roomy, 0.0), 1.0))
    expected = sum(_allocator_replay(sim.schedule, r, roomy if r == 2 else 0.0, 1.0)[0] for r in range(4))
    nothing = booked(HostMemory(0.0, 1.0))[0].fresh_bytes
    assert lopsided.fresh_bytes == pytest.approx(expected, abs=4) and lopsided.fresh_bytes < nothing
    # A rank alone with pages to work on does it in its own thread: one core, not two.
    alone, seconds = booked(HostMemory((0.0, roomy, roomy, roomy), (1.0, 0.0, 0.0, 0.0)))
    fresh, unmapped = _allocator_replay(sim.schedule, 0, 0.0, 1.0)
    assert alone.fresh_bytes == pytest.approx(fresh, abs=4) and alone.unmapped_bytes == pytest.approx(unmapped, abs=4)
    assert seconds == pytest.approx(fresh / 1e6 + unmapped / 4e6, rel=1e-6)
    # Without the two rates no page is booked; on GPUs (their caching allocator keeps its memory) none may be.
    work, seconds = booked(HostMemory(), rates=PageRates())
    assert seconds < 1e-9 and not work.seconds.any() and work.fresh_bytes > 0
    with pytest.raises(ValueError, match="host_cores=0"):
        booked(HostMemory(), cluster=dataclasses.replace(free, host_cores=0))
    with pytest.raises(ValueError, match="fresh_page_bandwidth"):
        PageRates(fresh_page_bandwidth=-1.0)
    for bad, match in (({"free_bytes": -1.0}, "free_bytes"), ({"mapped_share": 1.5}, "mapped_share")):
        with pytest.raises(ValueError, match=match):
            HostMemory(**bad)
    with pytest.raises(ValueError, match="2 figures for a switch of 4 processes"):
        page_work(sim.schedule, rates, HostMemory((0.0, 0.0), 1.0))


def test_the_shipped_cluster_file_reads_as_the_topology_preset():
    cluster = load_cluster(ROOT / "docs/topologies/cluster-dynatrain.yaml")
    assert (cluster.ranks, cluster.nics_per_host, cluster.nic_bandwidth) == (512, 8, 50e9)
    assert list(cluster.nic(np.arange(8, 12))) == [8, 9, 10, 11]
    cpu = cluster_from_dict({"preset": "cluster", "hosts": 1, "gpus_per_host": 4, "host_cores": 2,
                             "message_host_seconds": "30 us"})
    assert (cpu.host_cores, cpu.message_host_seconds) == (2, pytest.approx(30e-6))
    with pytest.raises(ValueError, match="unknown key.*fresh_page_bandwidth"):  # a host's pages: `host_memory`
        cluster_from_dict({"preset": "cluster", "hosts": 1, "fresh_page_bandwidth": "3GB/s"})
    with pytest.raises(ValueError, match="message_host_seconds: cannot read duration 'fast'"):
        cluster_from_dict({"preset": "cluster", "hosts": 1, "message_host_seconds": "fast"})
    with pytest.raises(ValueError, match="unknown key.*gpus"):
        cluster_from_dict({"preset": "cluster", "gpus": 8})
    with pytest.raises(ValueError, match="preset: cluster"):
        cluster_from_dict({"preset": "fat-tree", "hosts": 4})


def _simulate(capsys, *args) -> tuple[int, str, str]:
    code = main(["simulate", "switch", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_reports_every_figure_as_json(capsys):
    """The README's commands, at 256 ranks: a dense model on the shipped cluster, an MoE one on the default."""
    code, out, _ = _simulate(capsys, "--model", "qwen3-235b-a22b", "--ranks", "256", "--from", "dp=2,ep=4,tp=4,pp=8",
                             "--to", "dp=4,ep=2,tp=4,pp=8")
    assert code == 0 and "qwen3-235b-a22b: dp=2,ep=4,tp=4,pp=8 -> dp=4,ep=2,tp=4,pp=8 on 256 ranks" in out
    code, out, _ = _simulate(capsys, "--model", "llama3-70b", "--ranks", "256", "--from", "fsdp=4,tp=8,pp=8",
                             "--to", "dp=2,fsdp=2,tp=8,pp=8", "--cluster", str(ROOT / "docs/topologies/cluster-dynatrain.yaml"),
                             "--json")
    assert code == 0
    report = json.loads(out)
    assert report["cluster"].startswith("cluster-dynatrain: 64 host(s) x 8 GPUs")
    for key in ("bytes_moved", "bytes_kept", "bytes_lower_bound", "rounds", "peak_extra_bytes", "busiest_nic_bytes",
                "predicted_seconds", "plan_seconds", "schedule_seconds", "max_rss_bytes", "pieces_per_rank"):
        assert key in report, key
    assert 0 < report["host_calls_per_rank"] <= report["host_calls_per_rank_before"]
    assert report["bytes_moved"] == report["bytes_lower_bound"] > 0 and report["predicted_seconds"] > 0


@pytest.mark.parametrize("args, message", [
    (["--model", "llama3-70b", "--ranks", "16", "--from", "tp=16", "--to", "fsdp=16"], "--from tp=16: tp=16 does not divide"),
    (["--model", "qwen3-235b-a22b", "--ranks", "48", "--from", "ep=48", "--to", "dp=48"], "ep=48"),
    (["--model", "llama3-70b", "--ranks", "8", "--from", "ep=8", "--to", "dp=8"], "ep"),
    (["--model", "llama3-70b", "--ranks", "8", "--from", "fsdp=8", "--to", "dp=8", "--memory-per-rank", "141G"],
     "--to dp=8: .* of state on its busiest rank"),
    (["--model", "llama3-70b", "--ranks", "8", "--from", "fsdp=4", "--to", "dp=8"], "--from fsdp=4 has 4 ranks"),
    (["--model", "gpt-9", "--ranks", "4", "--from", "dp=4", "--to", "fsdp=4"], "gpt-9"),
])
def test_impossible_switches_are_refused_before_planning(capsys, args, message):
    code, out, err = _simulate(capsys, *args)
    assert code == 2 and not out
    assert re.search(message, err), err


def test_a_bfloat16_state_keeps_about_half_the_bytes():
    sizes = []
    for dtype in ("float32", "bfloat16"):
        sim = simulate_switch(model_space("tiny", dtype), Layout(dp=4), Layout(fsdp=4), Cluster(hosts=1, gpus_per_host=4))
        sizes.append(sim.plan.bytes_kept)
    assert model_space("tiny", "bfloat16").tensors[0].dtype == torch.bfloat16
    assert 0.45 * sizes[0] < sizes[1] < 0.6 * sizes[0]  # steps, progress and RNG keep their dtypes
