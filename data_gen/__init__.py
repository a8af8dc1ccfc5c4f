"""Stage package for data: corpora → ToolRequests (`requests`) and, later, the target's
own continuations of the training pool (`continuations`)."""
