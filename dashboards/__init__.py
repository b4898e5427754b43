"""The Dash app for TTFT breakdowns, request waterfalls and queue depth."""
