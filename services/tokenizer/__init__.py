"""The tokenizer service: tokenization, chat templates, length checks, detokenization, stop strings."""
