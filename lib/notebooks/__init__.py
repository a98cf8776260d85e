"""The machinery around the notebooks: running them headless (`make reproduce`) and
exporting them to offline HTML pages (`make report`)."""
