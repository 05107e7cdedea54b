"""The OpenAI-compatible HTTP server over one decode session (docs/SERVING.md): app (routes),
schemas (requests, errors), openai_api (prompts, responses, events), engine (the decode worker and
its queue), reply (streaming parse of reasoning / content / tool calls), metrics (Prometheus)."""
