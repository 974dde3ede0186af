"""The tokenizer service: tokenization, chat templates, length checks, detokenization, stop strings."""

from common.sampling import MAX_TOKENS_LIMIT

# A GenerateRequest whose sampling.max_tokens equals this asks for as many tokens as the context
# leaves after the prompt (OpenAI chat's default); only this service knows both lengths, so it
# resolves the value before scheduling. Clients' explicit max_tokens stay below it.
MAX_TOKENS_FROM_CONTEXT = MAX_TOKENS_LIMIT
