"""Tools for the hardware a deployment runs on, not jobs: `profile_steps` measures step
time against batch size and K into a calibration (`make calibrate`), `profile_report`
checks and plots it, `fit_calibration` holds the fits and writes the on-paper files."""
