"""`train_argv`: the `shardshift train` command line whose configuration is a given `TrainConfig`,
for harnesses that start a training run as a job of their own (the restart baseline in
`bench.restart`, the jobs of `bench.elastic`). `shardshift.cli.train.config_from_args` reads it
back."""

from __future__ import annotations


def train_argv(cfg, *, nproc: int, timeout_s: float) -> list[str]:
    """The `shardshift train` arguments whose configuration is `cfg` (`config_from_args` inverted),
    for jobs that start a training run of their own (the restart baseline of `bench switch`).

    Raises ValueError for a configuration the command line cannot express (a model or optimizer
    setting that has no flag)."""
    from shardshift.models import model_spec, names_a_model
    from shardshift.train.config import OptimConfig

    optim = OptimConfig(lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, grad_clip=cfg.optim.grad_clip)
    named = names_a_model(cfg.model.name)  # what --model can say
    if cfg.optim != optim or not named or model_spec(cfg.model.name) != cfg.model:
        raise ValueError(f"the configuration has settings no flag of `shardshift train` sets: {cfg.optim}, "
                         f"{cfg.model}")
    argv = ["train", "--nproc", str(nproc), "--layout", str(cfg.layout), "--model", cfg.model.name,
            "--steps", str(cfg.steps), "--stop-at", str(cfg.stop_at), "--seed", str(cfg.seed), "--dtype", cfg.dtype,
            "--global-batch", str(cfg.global_batch), "--lr", repr(cfg.optim.lr), "--warmup",
            str(cfg.optim.warmup_steps), "--grad-clip", repr(cfg.optim.grad_clip), "--log-every", str(cfg.log_every),
            "--switch-budget", str(cfg.switch_budget), "--timeout", repr(timeout_s)]
    if not cfg.auto_micro_batches:
        argv += ["--micro-batches", str(cfg.micro_batches)]
    if cfg.micro_batch_size:
        argv += ["--micro-batch-size", str(cfg.micro_batch_size)]
    if cfg.eval_every:
        argv += ["--eval-every", str(cfg.eval_every), "--eval-batches", str(cfg.eval_batches)]
    for flag, value in (("--data", cfg.data), ("--save", cfg.save), ("--resume", cfg.resume),
                        ("--metrics", cfg.metrics)):
        if value is not None:
            argv += [flag, value]
    if cfg.save_every:
        argv += ["--save-every", str(cfg.save_every)]
    if cfg.keep_checkpoints:
        argv += ["--keep-checkpoints", str(cfg.keep_checkpoints)]
    for step, layout in cfg.switches:
        argv += ["--switch", f"{step}:{layout}"]
    if cfg.collectives != "gloo":
        argv += ["--collectives", cfg.collectives]
    if cfg.topology is not None:
        argv += ["--topology", cfg.topology]
    if cfg.plot:
        argv += ["--plot"]
    return argv
