"""Writing and showing results: the evidence files and their figures, plots, an episode as
Markdown, replaying a recorded episode, and the trajectory browser."""
