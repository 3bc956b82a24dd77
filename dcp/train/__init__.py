"""The pretraining run: its config (``config``), planned global batches (``batches``), the loop
(``trainer``), the benchmark (``bench``) and the cost-model measurements (``measure``).
Checkpoint files are ``dcp.checkpoint``."""
