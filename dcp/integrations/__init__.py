"""DCP inside other training loops: ``megatron_lm`` plugs DCP into Megatron-LM's ``pretrain``."""
