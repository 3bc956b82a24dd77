"""The planned step, shared by every loop: planning a global batch (``BatchPlanner``), planning
ahead, online calibration, the step record and the micro-step time reduction. DCP's trainer,
Megatron-LM's loop and ``DCPEngine`` compose a step from these pieces alone."""
