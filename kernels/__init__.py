"""Resharding kernels (imported as `mtrain.kernels`)."""
