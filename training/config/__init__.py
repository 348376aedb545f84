"""The job config: the dataclass tree (job_config), its loading and every rule it must meet (validate)."""
