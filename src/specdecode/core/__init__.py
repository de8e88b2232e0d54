"""What the drafters and the engine share, below both: how a generator speculates (config),
how tokens are drawn (sampling), token trees and their exact multi-candidate rules (tree), a
round's drafts (proposal), what a drafter sees of the batch (draft_context), and the speed-up
formulas of the lessons (theory). Imports nothing of specdecode but errors and formats."""
