"""The pretraining run: its config (``config``), the loop (``trainer``), resume, the run lock,
signals, the ranks' agreement on failure and exit records, and the end-of-run comparison
(``run_summary``). Planned global batches are ``dcp.step``; checkpoint files ``dcp.checkpoint``;
the benchmarks and checks that drive the trainer ``dcp.bench``."""
