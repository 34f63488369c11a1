"""mtrain: a Megatron-core-native RL trainer with embedded SGLang (see README.md)."""
