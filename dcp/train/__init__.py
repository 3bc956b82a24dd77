"""The pretraining run: its config (``config``), planned global batches (``batches``), the loop
(``trainer``) and atomic checkpoints (``checkpoint``)."""
