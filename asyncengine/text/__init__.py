"""The output side: tokenizer and chat template, incremental detokenizer, stop strings, and the
per-request streams that hand text to callers. Nothing here touches the model or KV memory."""
