"""Examples to copy: a template agent (`examples.template_agent`)."""
