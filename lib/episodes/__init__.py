"""Playing episodes and recording them: scripted agents step by step, a language model as one
conversation in token space, and the records both write."""
