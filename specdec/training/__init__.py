"""Making drafts: corpora written by the target, distillation of standalone and feature
drafts, and the versioned prompt sets. Sits beside the apps (the CLI calls it); never imported
by the services."""
