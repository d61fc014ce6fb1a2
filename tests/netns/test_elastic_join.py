"""A worker on another (emulated) host joins a running elastic job through `--coordinator`.

Two network namespaces joined by a shaped bridge stand for two hosts. The job (its coordinator and
two workers) runs in the first, serving its store on that host's emulated address, which exists
nowhere else; `shardshift join --coordinator ADDRESS` runs in the second. Everything the joiner
does, from reading the job's command line to receiving its share of the state and training,
crosses the emulated network. The losses equal a fixed run's; no process is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from shardshift.netemu.shaping import uniform_rates
from support import REPO
from support.cli import coordinator_address
from support.training import metrics, step_losses

STEPS = 30
RUN = ["--model", "test", "--dtype", "float64", "--global-batch", "6", "--seed", "4", "--steps", str(STEPS),
       "--log-every", "1"]


def test_a_joiner_on_another_host_joins_through_the_coordinator_address(emulated_network, tmp_path, budget):
    fixed = subprocess.run([sys.executable, "-m", "shardshift", "train", *RUN, "--nproc", "1", "--metrics",
                            str(tmp_path / "fixed.jsonl")], capture_output=True, text=True, timeout=budget.left())
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    net = emulated_network(uniform_rates(2, 125e6), 2)  # 1 Gbit/s each way
    job = net.spawn(0, [sys.executable, "-m", "shardshift", "train", *RUN, "--elastic", "--nproc", "2",
                        "--max-nproc", "3", "--layout-for", "3:fsdp=3", "--coordinator", f"{net.address(0)}:0",
                        "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs")],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    joiner = None
    try:
        address = coordinator_address(job.stdout, until="step     2")
        assert address is not None and address.startswith(net.address(0)), address
        joiner = net.spawn(1, [sys.executable, "-m", "shardshift", "join", "--coordinator", address, "--timeout",
                               "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = job.communicate(timeout=budget.left())
        joined_out, joined_err = joiner.communicate(timeout=60)
    finally:
        for proc in (job, joiner):
            if proc is not None:
                proc.kill()
    assert job.returncode == 0, err[-3000:]
    assert joiner.returncode == 0, joined_err[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["to"]) for e in events] == [("join", 2, 3, "fsdp=3")]
    assert events[0]["bytes_moved"] > 0 and events[0]["step"] < STEPS
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the job left: {left}"
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(tmp_path / "fixed.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([want[s] for s in sorted(want)]),
                               rtol=1e-9, atol=0)


HOST_LOSS_STEPS = 400  # more than the test runs: it stops the job once the host's loss is survived


def _private_tmp(argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own with an empty /tmp: a host that shares no temporary
    directory (nor anything written there) with the first. What the command needs from /tmp (this
    checkout and its Python, when they live there: a fresh clone in CI) is bound back in, from a
    view of the old /tmp kept at /mnt (a mount of the private namespace only)."""
    tmp = Path("/tmp")
    needed = sorted({str(p) for p in (REPO.resolve(), Path(sys.prefix).resolve()) if tmp in p.parents})
    script = "mount --bind /tmp /mnt && mount -t tmpfs tmpfs /tmp"
    for path in needed:
        script += f' && mkdir -p "{path}" && mount --bind "/mnt/{Path(path).relative_to(tmp)}" "{path}"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script + ' && exec "$@"', "sh",
            *argv]


class _Lines:
    """A process's output lines, read as they come, from a thread of their own."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.stream = stream
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            self.lines.extend(self.stream)
        except ValueError:  # closed under it: the process was killed
            pass

    def wait_for(self, pattern: str, deadline: float, after: int = 0, also: Path | None = None,
                 alive=lambda: True) -> int:
        """The index of the first line from `after` on that matches `pattern`, waiting for it while
        `alive()`. `also`: a log to show as well if none comes."""
        regex = re.compile(pattern)
        while time.monotonic() < deadline and alive():
            for i, line in enumerate(self.lines[after:], after):
                if regex.search(line):
                    return i
            time.sleep(0.05)
        more = f"\n{also}:\n{also.read_text()[-3000:]}" if also is not None and also.exists() else ""
        raise AssertionError(f"no line matched {pattern!r}; the output:\n" + "".join(self.lines[-40:]) + more)


def test_a_host_lost_with_all_its_workers_is_survived_from_copies_kept_on_the_other(emulated_network, tmp_path,
                                                                                   budget):
    """Two emulated hosts that share no /tmp (separate mount namespaces). The job starts on host 0
    with 2 workers; `shardshift join --nproc 2` on host 1 brings it to 4 (fsdp=4, --redundancy 1; the
    two are admitted together, or one boundary apart).
    The copies go to the other host: when every process of host 1 is SIGKILLed at once, the two
    workers of host 0 hold a copy of every piece, and go on with no step lost (on the old rule,
    rank 2's copy was on rank 3, lost with it, and with no checkpoint the job stopped). Stopped by
    a signal once the loss is survived, the job's losses equal a fixed run's up to its last step;
    no process is left on either host."""
    net = emulated_network(uniform_rates(2, 125e6), 2)
    run = [*RUN[:-4], "--steps", str(HOST_LOSS_STEPS), "--log-every", "1"]  # RUN's model, batch and seed
    job = net.spawn(0, [sys.executable, "-m", "shardshift", "train", *run, "--elastic", "--nproc", "2",
                        "--max-nproc", "4", "--redundancy", "1", "--layout-for", "4:fsdp=4", "--layout-for", "3:fsdp=3",
                        "--layout-for", "2:fsdp=2", "--coordinator", f"{net.address(0)}:0", "--metrics",
                        str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs")],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joiners = None
    try:
        out = _Lines(job.stdout)
        deadline = time.monotonic() + budget.left() - 30
        first = out.wait_for(r"coordinator at \S+:\d+:", deadline)
        address = re.search(r"coordinator at (\S+?:\d+):", out.lines[first]).group(1)
        host1_log = tmp_path / "host1.log"
        with open(host1_log, "w") as log:
            joiners = net.spawn(1, _private_tmp([sys.executable, "-m", "shardshift", "join", "--coordinator", address,
                                                 "--nproc", "2", "--timeout", "120"]), stdout=log, stderr=log)
        joined = out.wait_for(r"^join: [23] -> 4 workers", deadline, also=host1_log,  # both, at once or not
                              alive=lambda: joiners.poll() is None)
        out.wait_for(r"^step ", deadline, after=joined + 3)  # a few steps in the world of both hosts
        host1 = subprocess.run(["ip", "netns", "pids", net.namespace(1)], capture_output=True, text=True).stdout.split()
        assert len(host1) >= 3, host1  # `join --nproc 2` and its two workers
        for pid in host1:
            os.kill(int(pid), signal.SIGKILL)  # the host is gone, all at once
        crashed = out.wait_for(r"^crash: 4 -> 2 workers", deadline)
        out.wait_for(r"^step ", deadline, after=crashed + 3)
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (job, joiners):
            if proc is not None:
                proc.kill()
    assert job.returncode == 128 + signal.SIGTERM, "".join(out.lines[-40:])
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    # Host 1's two workers may be found silent together (one crash) or half a second apart (the
    # second breaks the recovery from the first, which goes back and tries again without both).
    changes = [(e["kind"], e["from_world"], e["to_world"], e["steps_lost"]) for e in events]
    assert changes in ([("join", 2, 4, 0), ("crash", 4, 2, 0)],
                       [("join", 2, 3, 0), ("join", 3, 4, 0), ("crash", 4, 2, 0)]), changes
    assert events[-1]["recovered_from"] in ("redundancy", "rollback"), events[-1]
    got = step_losses(tmp_path / "elastic.jsonl")
    last = max(got)
    fixed = subprocess.run([sys.executable, "-m", "shardshift", "train", *run, "--nproc", "1", "--stop-at", str(last),
                            "--metrics", str(tmp_path / "fixed.jsonl")], capture_output=True, text=True,
                           timeout=budget.left())
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    want = step_losses(tmp_path / "fixed.jsonl")
    assert sorted(got) == list(range(1, last + 1)) == sorted(want)
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([want[s] for s in sorted(want)]),
                               rtol=1e-9, atol=0)
    for namespace in (net.namespace(0), net.namespace(1)):
        left = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
        assert not left, f"processes left on {namespace}: {left}"
