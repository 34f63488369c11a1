"""Model classes mtrain registers with SGLang through its external-model extension point
(`SGLANG_EXTERNAL_MODEL_PACKAGE`, sglang/srt/models/registry.py: every module here with an `EntryClass` is imported by
the engine's scheduler processes). Only model modules belong in this package: the registry imports each of them."""
