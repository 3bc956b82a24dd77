"""What the benchmarks and checks of ``tools/`` run, above the trainer and the runtime they drive:
the end-to-end benchmark (``e2e``, ``tools.bench_e2e``), a checkpoint's cost (``checkpoint``,
``tools.bench_checkpoint``), start-up and planning at scale (``scale``, ``tools.bench_scale``),
the cost-model measurements (``measure``, ``tools.profile``) and the stock-PyTorch GPU check
(``bare_check``, ``tools.gpu_check --bare``). A training run imports none of them."""
