"""The launcher (`shardshift.launch`, behind `shardshift train` and the benchmarks): bad input exits
2 before any process starts, an error or a death in one rank stops the others, and a launcher that
is stopped or killed, while its ranks start or while they train, leaves no rank behind (checked by
PID)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from support.dist import pid_alive
from support.faults import fault_env

TRAIN = [sys.executable, "-m", "shardshift", "train", "--nproc", "2", "--layout", "fsdp=2", "--model", "test"]


def _pids(marker: str) -> list[int]:
    """PIDs of the processes whose command line holds `marker`."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(pid) for pid in pids)


@contextlib.contextmanager
def _training(tmp_path, until_step: int | None, logs: bool = True):
    """A 2-rank job that would train for ever (its own text file marks its processes), once it
    reached `until_step` (None: as soon as its first rank exists): the launcher and the ranks'
    PIDs. The launcher is killed on the way out, whatever the test did."""
    text = tmp_path / "corpus.txt"
    text.write_text("All the world's a stage, and all the men and women merely players. " * 200)
    launcher = subprocess.Popen([*TRAIN, "--steps", "100000", "--data", str(text), "--timeout", "600",
                                 *(["--log-dir", str(tmp_path / "logs")] if logs else [])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = []
        if until_step is None:
            while not ranks:
                assert launcher.poll() is None, launcher.stderr.read()
                ranks = [pid for pid in _pids(str(text)) if pid != launcher.pid]
        else:
            for line in launcher.stdout:
                if line.startswith(f"step {until_step:5d}"):
                    break
            ranks = [pid for pid in _pids(str(text)) if pid != launcher.pid]
            assert len(ranks) == 2, launcher.stderr.read()[-2000:]
        yield launcher, ranks
    finally:
        launcher.kill()
        launcher.wait()
    assert _gone(_pids(str(text))), "a rank outlived its launcher"  # they stop after their step


def test_invalid_layout_from_the_shell_exits_2(budget):
    run = subprocess.run([*TRAIN[:4], "--nproc", "3", "--layout", "tp=3"], capture_output=True, text=True,
                         timeout=budget.left())
    assert run.returncode == 2
    assert "tp=3 does not divide n_head=8; choose tp in {1, 2, 4, 8}" in run.stderr


def test_worker_error_stops_the_job_with_its_message(tmp_path, budget):
    """Rank 1 fails as it starts training (an injected fault: every input was valid, so only a
    worker can fail), while rank 0 waits for it in the group."""
    env = fault_env(tmp_path, 1, "worker_main", 'sys.exit("injected: rank 1 cannot start")')
    run = subprocess.run([*TRAIN, "--steps", "100000", "--log-dir", str(tmp_path / "logs")], capture_output=True,
                         text=True, timeout=budget.left(), env=env)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "worker rank 1 exited with code 1; stopped the other workers" in run.stderr
    assert "injected: rank 1 cannot start" in run.stderr  # its last lines, repeated from its log
    assert f"the output of rank 1 is in {tmp_path / 'logs'}" in run.stderr
    assert (tmp_path / "logs" / "rank-1.log").read_text().strip().endswith("injected: rank 1 cannot start")


def test_a_killed_worker_stops_the_others_instead_of_hanging(tmp_path, budget):
    with _training(tmp_path, until_step=2) as (launcher, ranks):
        os.kill(ranks[1], signal.SIGKILL)
        # The collective timeout is 600 s: finishing well within the budget shows the launcher
        # stopped the survivor itself instead of waiting for gloo to notice.
        assert launcher.wait(timeout=budget.left()) == 128 + signal.SIGKILL
        assert "worker rank 1 exited with code -9; stopped the other workers" in launcher.stderr.read()
        assert _gone(ranks)


def test_sigterm_while_the_ranks_start_stops_them_all(tmp_path, budget):
    with _training(tmp_path, until_step=None) as (launcher, ranks):
        launcher.send_signal(signal.SIGTERM)  # the ranks are starting, or importing torch
        assert launcher.wait(timeout=budget.left()) == 128 + signal.SIGTERM
        assert _gone(ranks)


def test_a_launcher_killed_mid_training_leaves_no_rank(tmp_path, budget):
    """Nor its temporary directory (store and logs), which no handler of it could remove: the ranks
    do as they stop (checked by the autouse fixture of tests/conftest.py)."""
    with _training(tmp_path, until_step=2, logs=False) as (launcher, ranks):
        launcher.kill()  # SIGKILL: no handler runs; the ranks learn it from the kernel
        launcher.wait(timeout=30)
        assert _gone(ranks), [pid for pid in ranks if pid_alive(pid)]


def test_the_command_line_parses_without_importing_torch(budget):
    """Every rank of a job parses the whole command line again: that must stay cheap."""
    code = ("import sys; from shardshift.cli.main import build_parser; "
            "[build_parser([c]) for c in ('train', 'topo', 'bench', '--help')]; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('scipy')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=budget.left())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_the_launcher_checks_a_run_without_torch(budget):
    """Importing torch takes more than a second of CPU: the launcher's checks (configuration, data,
    checkpoints) must not need it, so that bad input fails at once. (The launcher imports it once
    its checks passed, just before it forks the ranks.) The ranks are replaced by a stand-in."""
    code = ("import sys; from shardshift import launch; from shardshift.cli.main import main; "
            "launch.launch = lambda *a, **k: 0; "
            "code = main(['train', '--nproc', '4', '--layout', 'fsdp=2,pp=2', '--model', 'test', '--steps', '3', "
            "'--switch', '2:dp=4']); "
            "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('scipy')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=budget.left())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "0 []", run.stdout


def test_a_local_job_listens_on_loopback_only(tmp_path, budget):
    with _training(tmp_path, until_step=2) as (launcher, ranks):
        sockets = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
        mine = [line.split()[3] for line in sockets if any(f"pid={pid}," in line for pid in ranks)]
        assert mine, sockets  # gloo listens for its peers
        assert all(addr.startswith(("127.", "[::1]")) for addr in mine), mine


def _ready(script: str) -> subprocess.Popen:
    """A process running `script`, once it printed that it is ready (its signal handlers set)."""
    proc = subprocess.Popen([sys.executable, "-c", script + "\nprint('ready', flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_ranks_that_do_not_stop_cleanly_after_a_signal_are_named():
    """After a signal the launcher gives the ranks `drain_s`: one that is still running then is
    killed (its checkpoint unfinished) and one that fails while stopping is named with its code."""
    from shardshift.launch import _stopped, supervise

    procs = [_ready("import time"),  # SIGTERM ends it: a clean stop
             _ready("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"),  # still saving
             _ready("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))")]
    try:
        outcome = supervise(procs, cancelled=lambda: True, drain_s=1.0, grace_s=1.0)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert outcome.cancelled and outcome.codes == (-signal.SIGTERM, None, 7)
    message = _stopped(signal.SIGHUP, outcome, 1.0)
    assert message.startswith("shardshift: stopped by signal 1; ranks [1] had not finished within 1 s, and were "
                              "killed: a checkpoint they were writing is unfinished"), message
    assert message.endswith("ranks [2] exited with [7] while stopping"), message


def test_a_log_dir_keeps_the_logs_of_earlier_jobs(tmp_path):
    from shardshift.launch import launch

    for _ in range(2):
        assert launch(2, ["--help"], log_dir=str(tmp_path / "logs")) == 0
    log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert log.count("shardshift --help: rank 1 ===") == 2 and log.count("usage: shardshift") == 2, log


def test_a_rank_whose_launcher_died_before_it_asked_to_die_with_it_exits():
    """`die_with_parent` asks Linux for SIGTERM when the parent dies; if the parent died before
    the ask (between fork and prctl), the child is already an orphan and exits at once. The
    orphan is made by naming another process as the parent the child must have."""
    import functools

    from shardshift.launch import die_with_parent, dies_with_this_process

    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              preexec_fn=functools.partial(die_with_parent, os.getpid() + 1_000_000))
    bound = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=dies_with_this_process())
    try:
        assert orphan.wait(timeout=10) == 128 + signal.SIGTERM
        assert bound.poll() is None  # its parent is alive: it runs
    finally:
        for proc in (orphan, bound):
            proc.kill()
            proc.wait()


def test_a_rank_leaves_with_its_status_and_output_but_without_the_teardown(tmp_path):
    """`shardshift` run as a rank ends through `runtime.leave`: its exit status and its buffered
    output survive, the interpreter's teardown (where torch's threads can abort a finished rank)
    does not run: an atexit handler that would write a file never does."""
    marker = tmp_path / "teardown-ran"
    code = (f"import atexit, pathlib, sys; atexit.register(pathlib.Path({str(marker)!r}).touch); "
            "sys.stdout.write('no newline, still in the buffer'); "
            "from shardshift.cli.main import main; main(['train', '--steps', '0'])")
    rank = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    assert rank.returncode == 2 and "--steps" in rank.stderr, rank.stderr
    assert rank.stdout == "no newline, still in the buffer"
    assert not marker.exists()
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert alone.returncode == 0 and marker.exists(), alone.stderr  # not a rank: an ordinary exit


def test_a_rank_killed_by_a_signal_is_named_before_the_peers_that_failed_after_it():
    """When a rank is killed and its peer then fails on the broken connection, both may have
    exited by the time the launcher looks: the killed one is the cause, and is named."""
    from shardshift.launch import supervise

    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    failing.wait(timeout=30)
    killed.wait(timeout=30)
    outcome = supervise([failing, killed], timeout_s=30)
    assert outcome.failed == 1 and outcome.codes == (1, -signal.SIGKILL)


def test_a_forked_rank_runs_its_command_with_its_own_streams_session_and_name(tmp_path):
    """`fork_rank` as the launcher and the coordinator use it, on commands that need no group:
    the fork's output goes where it was sent, its exit status (a usage error: 2) is what the
    interpreter would give, it leads a session of its own under its own name, and a fork that
    does not end is waited for with a timeout and killed like any child."""
    import socket

    from shardshift.launch import fork_rank

    out = tmp_path / "out.log"
    with open(out, "ab") as log:
        helped = fork_rank(3, ["--help"], dict(os.environ), stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT)
        refused = fork_rank(4, ["train", "--layout", "tp=3", "--nproc", "3"], dict(os.environ), stdout=log,
                            stderr=subprocess.STDOUT)
        assert helped.wait(timeout=60) == 0 and refused.wait(timeout=60) == 2
    text = out.read_text()
    assert "usage: shardshift" in text and "tp=3 does not divide n_head=8" in text, text
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers: the joiner waits
        port = silent.getsockname()[1]
        with open(out, "ab") as log:
            waiting = fork_rank(5, ["join", "--coordinator", f"127.0.0.1:{port}", "--timeout", "60"], dict(os.environ),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            assert os.getsid(waiting.pid) == waiting.pid
            assert open(f"/proc/{waiting.pid}/comm").read().strip() == "rank-5"
            with contextlib.suppress(subprocess.TimeoutExpired):
                waiting.wait(timeout=0.5)
                raise AssertionError("the joiner ended without a coordinator to answer it")
            waiting.kill()
            assert waiting.wait(timeout=30) == -signal.SIGKILL
        finally:
            waiting.kill()
            waiting.poll()
    assert not pid_alive(waiting.pid)
