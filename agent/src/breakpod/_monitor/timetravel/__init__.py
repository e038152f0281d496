"""Time travel: each step's inputs kept (``capture``), the step run again op by op
(``replay``, over ``opwatch``'s dispatch check) and the next step tried under a change
(``whatif``)."""
