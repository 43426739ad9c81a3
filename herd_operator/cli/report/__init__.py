"""`herd-operator report`: a timeline figure or a text summary of a run, from the state store.

`command` (the options and what the command does), `series` (the store read into plain
series), `figure_data` (the figure's numbers, pure), `figure` (matplotlib), `text`.
"""
