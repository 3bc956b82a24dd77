"""What ``python -m tools.gpu_check --bare`` measures on a stock-PyTorch GPU machine (no
Transformer Engine): fp64 parity and training steps (``parity``), MFU and a cost-model
calibration (``perf``), CP = 2 with two processes on one device (``cp2``), the real entry points
launched (``entry``), and the sequence that runs them with its sizes and verdicts (``checks``).
Each function takes its sizes and the device, so the whole sequence also runs at tiny sizes on a
CPU."""
