"""What a run reports: the typed per-step record (``record``), the memory probe (``memory``),
JSONL + W&B logging (``metrics``) and run provenance (``run_info``)."""
