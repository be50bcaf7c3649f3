"""The flight recorder: ``openforge ui``, a web view from the reward curve down to the tokens.

It follows the topics through the project's own consumer into a bounded local SQLite index
(:mod:`openforge.ui.index`) and serves server-rendered pages (:mod:`openforge.ui.pages`): runs,
rollouts, a rollout with its calls and token view, learner steps and the harness report. Whole
events (a call's messages, a trajectory's tokens) are read back from Kafka by position when a page
shows them, so the index holds summaries only.
"""
