"""Process-wide primitives: settings, errors, the event hub, holds, addresses."""
