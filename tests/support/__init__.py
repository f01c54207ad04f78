"""What several test modules share: fakes, in-process clusters, apps, configurations and helpers.
No test module imports another; they import from here."""
