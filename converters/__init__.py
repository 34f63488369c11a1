"""Weight converters (imported as `mtrain.converters`): HF <-> Megatron dist checkpoint, GGUF -> HF, Megatron -> SGLang shards."""
