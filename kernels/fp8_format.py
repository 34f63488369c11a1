"""The FP8 number format of every engine FP8 weight (block and per-channel): e4m3fn and its largest finite value.
Its own module so that the block (fp8.py) and per-channel (fp8_channel.py) quantizers share it without importing each
other."""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
