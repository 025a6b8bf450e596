"""Model clients and what feeds them: the OpenAI Chat Completions client and its error mapping,
the local llama.cpp model, the scripted model and its scenarios, admission to endpoints."""
