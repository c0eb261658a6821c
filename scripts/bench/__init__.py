"""The ops of scripts/benchmark.py, one module each, over the shared helpers in ``common``
(timing, arguments, run header, JSON), ``peers`` (the other implementations), ``scans`` (the
harness of the scan ops) and ``report`` (markdown sections and pictures). ``OPS`` maps each
``--op`` to its module; a module holds ``run(args) -> (exit status, report or None)`` and may
add ``add_arguments(parser)``, ``check(args, parser)``, ``markdown(report, args)`` and
``plot(report, path)``."""

OPS = {
    "selective": "selective",
    "linear": "linear",
    "trapezoidal": "trapezoidal",
    "ssd": "ssd",
    "generate": "generate",
    "decode": "decode",
    "decode-table": "decode_table",
    "packed": "packed",
    "layer": "layer",
    "train-step": "train_step",
    "hybrid": "hybrid",
    "text": "text",
    "cold-start": "cold_start",
    "memory": "memory",
    "saved": "saved",
    "precision": "precision",
    "gpu-peers": "gpu_peers",
    "context-parallel": "context_parallel",
}
