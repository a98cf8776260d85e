"""Agents: the scripted baselines and the LLM policy's prompt and reply parser."""
