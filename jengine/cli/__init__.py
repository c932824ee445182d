"""The `jengine` command (`jengine.cli.main`). Nothing else imports this package."""
