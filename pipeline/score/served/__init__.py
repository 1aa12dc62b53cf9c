"""A served teacher: the score stage's engine behind a running vLLM OpenAI-compatible server (`gkd score
--teacher-url`). client.py is the engine (`ServedTeacher`); probe.py its identity (fingerprint from a fixed probe);
access.py the URL, API key and TLS checks; logprobs.py the JSON answer in the in-process engine's layout."""
