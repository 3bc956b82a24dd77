"""The pretraining run: its config (``config``), planned global batches (``batches``), the loop
(``trainer``), the benchmark (``bench``), the cost-model measurements (``measure``) and the
stock-PyTorch GPU check (``bare_check``).
Checkpoint files are ``dcp.checkpoint``."""
