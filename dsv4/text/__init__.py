"""Text to token ids and back: `tokenizer` (the DeepSeek-V4 tokenizer, prompt and follow-up ids,
incremental detokenizing) and `chat` (the official chat encoding, byte for byte, and the parse of
a completion into content, reasoning and tool calls). Imports errors only.
"""
