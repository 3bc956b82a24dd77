"""Weights in and out of DCP: the canonical parameter naming (``canonical``) and Hugging Face
checkpoints (``hf_config``: config.json ↔ ``ModelConfig``; ``hf``: tensor mapping;
``convert``: streaming import/export, ``load_hf_model``)."""
