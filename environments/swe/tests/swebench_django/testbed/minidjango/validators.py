"""Username and password validators (shaped like django.contrib.auth.validators)."""

import re


class ValidationError(Exception):
    """A value failed validation."""


class RegexValidator:
    regex = ""
    flags = 0
    message = "Enter a valid value."

    def __init__(self):
        self._compiled = re.compile(self.regex, self.flags)

    def __call__(self, value):
        if not self._compiled.search(str(value)):
            raise ValidationError(self.message)


class ASCIIUsernameValidator(RegexValidator):
    regex = r"^[\w.@+-]+$"
    message = "Enter a valid username: English letters, numbers and @/./+/-/_ only."
    flags = re.ASCII


class UnicodeUsernameValidator(RegexValidator):
    regex = r"^[\w.@+-]+$"
    message = "Enter a valid username: letters, numbers and @/./+/-/_ only."


class MinimumLengthValidator:
    def __init__(self, min_length=8):
        self.min_length = min_length

    def validate(self, password):
        if len(password) < self.min_length:
            raise ValidationError(f"This password is too short. It must contain at least {self.min_length} characters.")
